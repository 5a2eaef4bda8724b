"""What the HTTP front door adds to a request, against what SGLang itself spends parsing it.

Every request body now passes ``sglang_pic.frontdoor`` (route, size, schema) before SGLang's
FastAPI route parses it again. This measures, on this machine, per body:

* ``front door``: the ``FrontDoor`` middleware admitting the request (reading the body, the span
  rewrite's parse, the schema) in front of an app that does nothing;
* ``SGLang parse``: what SGLang's own route does with the same bytes before any model work
  (``orjson.loads`` and ``GenerateReqInput`` / ``ChatCompletionRequest`` validation, as
  FastAPI runs them);

for prompts of 1K to 128K tokens, as text, as token ids, and as an OpenAI chat body; ``repeats``
samples each (median and spread). The ratio is the front door's time over SGLang's parse; the
absolute time is what a request waits longer. Runs on CPU (the HTTP process is the same on a GPU
machine), in one process:

    .venv/bin/python -m benchmark.bench_front_door [--repeats 15] [--out DIR]

Writes ``front_door_overhead_<machine>.json`` (machine, versions, config, every sample) and a
figure, and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import time
from pathlib import Path

from benchmark import description

HERE = Path(__file__).resolve().parent

LENGTHS = (1024, 8192, 32768, 131072)
WORD = "lorem "  # one token of SmolLM2's tokenizer per word, about


def bodies(tokens: int) -> dict[str, tuple[str, bytes]]:
    """``{case: (path, body)}`` for a prompt of about ``tokens`` tokens."""
    sp = {"max_new_tokens": 16, "temperature": 0}
    text = WORD * tokens
    return {
        "generate, text": ("/generate", json.dumps({"text": text, "sampling_params": sp})
                           .encode()),
        "generate, ids": ("/generate", json.dumps({"input_ids": [(i * 7919) % 49000
                                                                 for i in range(tokens)],
                                                   "sampling_params": sp}).encode()),
        "chat": ("/v1/chat/completions", json.dumps({
            "model": "m", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": text}]}).encode()),
    }


def front_door():
    from sglang_pic.frontdoor.middleware import FrontDoor, FrontDoorConfig

    async def app(scope, receive, send):  # SGLang's stack stands here; nothing runs
        await receive()

    config = FrontDoorConfig(max_body_bytes=64 << 20, body_timeout_s=60, admin_api_key=None,
                             admin_path_roots=(), weights_from_tensor=False, span_cache=True,
                             vocab_size=lambda: 49152)
    return FrontDoor(app, config)


LOOP = asyncio.new_event_loop()


def time_front_door(door, path: str, raw: bytes) -> float:
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        raise AssertionError(f"refused: {message}")

    async def timed() -> float:
        t0 = time.perf_counter()
        await door(scope, receive, send)
        return time.perf_counter() - t0

    return LOOP.run_until_complete(timed())


@functools.cache
def generate_adapter():
    """FastAPI's validator of ``GenerateReqInput`` (built once, as FastAPI builds it)."""
    from pydantic import TypeAdapter
    from sglang.srt.managers.io_struct import GenerateReqInput

    return TypeAdapter(GenerateReqInput)


def time_sglang_parse(path: str, raw: bytes) -> float:
    import orjson
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    adapter = generate_adapter()
    t0 = time.perf_counter()
    data = orjson.loads(raw)
    if path == "/generate":
        adapter.validate_python(data)
    else:
        ChatCompletionRequest.model_validate(data)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()

    from sglang_pic.cpu import support as cpu_support

    cpu_support.enable_cpu_engine()
    from benchmark.harness import environment, gpu_tag, save_figure

    door = front_door()
    rows, samples = [], {}
    for tokens in LENGTHS:
        for case, (path, raw) in bodies(tokens).items():
            time_front_door(door, path, raw)  # warm: schemas built, imports done
            time_sglang_parse(path, raw)
            ours, theirs = [], []
            for i in range(args.repeats):  # alternate which goes first
                if i % 2:
                    theirs.append(time_sglang_parse(path, raw))
                ours.append(time_front_door(door, path, raw))
                if not i % 2:
                    theirs.append(time_sglang_parse(path, raw))
            key = f"{case}, {tokens // 1024}K"
            samples[key] = {"front_door_s": ours, "sglang_parse_s": theirs, "bytes": len(raw)}
            m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
            rows.append({"case": key, "bytes": len(raw), "front_door_ms": m_ours * 1e3,
                         "front_door_spread_ms": [min(ours) * 1e3, max(ours) * 1e3],
                         "sglang_parse_ms": m_theirs * 1e3,
                         "ratio": m_ours / m_theirs})
            print(f"{key:24s} {len(raw) / 1024:9.0f} KiB  front door {m_ours * 1e3:8.2f} ms "
                  f"[{min(ours) * 1e3:.2f}-{max(ours) * 1e3:.2f}]  SGLang's parse "
                  f"{m_theirs * 1e3:8.2f} ms  ratio {m_ours / m_theirs:5.2f}", flush=True)
    report = {"benchmark": "front_door_overhead", "environment": environment(),
              "config": {"repeats": args.repeats, "lengths": LENGTHS},
              "rows": rows, "samples": samples}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"front_door_overhead_{gpu_tag()}.json"
    path.write_text(json.dumps(report, indent=1))
    _plot(rows, out, save_figure)
    print(f"wrote {path}")


def _plot(rows: list[dict], out: Path, save_figure) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [r["case"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["sglang_parse_ms"] for r in rows], 0.4,
           label="SGLang's own parse")
    ax.bar([i + 0.2 for i in x], [r["front_door_ms"] for r in rows], 0.4, label="front door")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per request (median)")
    ax.set_title("Front door vs SGLang's own request parsing (CPU)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "front_door_overhead.png")


if __name__ == "__main__":
    main()
