"""TTFT of a prefix computed by *another* instance: recompute vs SGLang's `file` backend vs PTStore.

One GPU, instances one after the other (each its own process and Engine, so the reader has never
seen the prefixes and shares no GPU or host memory with the writer):

* ``vanilla``: vanilla SGLang 0.5.17, no HiCache: the reader recomputes the prefix;
* ``vanilla-file-writer`` then ``vanilla-file``: vanilla SGLang with HiCache and its built-in
  ``file`` storage backend (a directory on the node's disk); the writer computes the prefixes and
  waits until they are written through to storage, the reader loads them;
* ``sglang-pic-ptstore-writer`` then ``sglang-pic-ptstore``: the same with PTStore (three store
  servers on this node, started by this script) as the ``dynamic`` backend; the servers are on
  the reader's node and SGLang's host pool is in shared memory (``"allocator": "shm"``, as
  ``--ptstore`` sets it), so the servers write the pages straight into the reader's host pool;
* ``sglang-pic-ptstore-fastgil``: the PTStore reader with ``"gil_switch_ms": 0.5`` (the
  scheduler process hands the GIL to its HiCache threads within 0.5 ms instead of 5 ms);
* ``sglang-pic-ptstore-staging``: the PTStore reader with a private host pool: pages come
  through its shared-memory staging segment and are copied into the pool by the reader;
* ``sglang-pic-ptstore-socket``: the PTStore reader with the shared-memory path off (every page
  over loopback TCP, as from servers on other nodes).

Prefixes of 1K/2K/4K/8K tokens (several samples each) + a fresh 64-token question, one output
token. Llama-3-8B shape, dummy weights, triton attention, bf16, page size 64, HiCache write-through
and ``wait_complete`` prefetch. The reader reports TTFT and where the cached tokens came from.

    python3 benchmark/store/bench_store_ttft.py [--out DIR] [--samples 3]
    python3 benchmark/store/bench_store_ttft.py --replot benchmark/results/store_ttft_h200_pool.json

Prints a table and writes the JSON and a plot (``docs/figures/<name>.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from harness import LLAMA3_8B_DUMMY, store_totals  # noqa: E402

REPO = HERE.parent.parent
LENGTHS = (1024, 2048, 4096, 8192)


def _role() -> tuple[str, bool]:
    variant = os.environ.get("SGLANG_PIC_BENCH_VARIANT", "vanilla")
    return variant.removesuffix("-writer"), variant.endswith("-writer")



def _prefixes(params: dict) -> dict[int, list[list[int]]]:
    import numpy as np

    rng = np.random.default_rng(params["seed"])
    return {n: [[int(t) for t in rng.integers(1000, params["vocab"], size=n)]
                for _ in range(params["samples"])] for n in params["lengths"]}


def _stored_bytes(params: dict, kind: str) -> int:
    if kind.endswith("file"):
        root = Path(params["file_dir"])
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return store_totals(params["servers"], params["token"], ("bytes_in",))["bytes_in"]


def workload(engine_kwargs: dict, params: dict) -> dict:
    import sglang as sgl

    kind, writer = _role()
    kwargs = dict(engine_kwargs)
    if not Path(kwargs["model_path"]).is_absolute():
        kwargs["model_path"] = str(REPO / kwargs["model_path"])
    lengths = params["lengths"]
    vocab = params["vocab"]
    if kind != "vanilla":
        kwargs.update(params.get("hicache_kwargs", {}))
        kwargs.update(enable_hierarchical_cache=True, hicache_size=params["hicache_gb"],
                      hicache_write_policy="write_through",
                      hicache_storage_prefetch_policy="wait_complete")
        if kind.endswith("file"):
            os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = params["file_dir"]
            kwargs["hicache_storage_backend"] = "file"
        else:
            kwargs["hicache_storage_backend"] = "dynamic"
            os.environ["SGLANG_PIC_PTSTORE_TOKEN"] = params["token"]  # the schedulers inherit it
            kwargs["hicache_storage_backend_extra_config"] = json.dumps({
                "backend_name": "ptstore", "module_path": "sglang_pic.store.hicache_backend",
                "class_name": "PTStoreHiCacheStorage", "servers": params["servers"],
                "interface_v1": 1,
                "shm": not kind.endswith("-socket"),
                # as --ptstore sets it; "-staging": the host pool in private memory, pages
                # come through the reader's staging segment
                **({} if kind.endswith("-staging") else {"allocator": "shm"}),
                **({"gil_switch_ms": 0.5} if kind.endswith("-fastgil") else {})})
    prefixes = _prefixes(params)
    t0 = time.perf_counter()
    engine = sgl.Engine(**kwargs)
    result: dict = {"engine_start_s": time.perf_counter() - t0, "role": "writer" if writer else "reader"}
    import numpy as np

    rng = np.random.default_rng(params["seed"] + (1 if writer else 2))

    def question() -> list[int]:
        return [int(t) for t in rng.integers(1000, vocab, size=params["question_tokens"])]

    def ttft(ids: list[int]) -> tuple[float, dict]:
        t, wall = time.perf_counter(), time.time()
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
        dt = time.perf_counter() - t
        if os.environ.get("SGLANG_PIC_STORE_TRACE") == "1":
            print(f"[ptstore-trace] request at {wall:.3f}: {len(ids)} tokens, TTFT {1000 * dt:.1f} ms",
                  file=sys.stderr, flush=True)
        return dt, out["meta_info"]

    try:
        for n in lengths:  # warm-up: JIT for every shape class, on prompts nobody else uses
            ttft([int(t) for t in rng.integers(1000, vocab, size=n + params["question_tokens"])])
        if writer:
            for n in lengths:
                for p in prefixes[n]:
                    ttft(p + question())
            # write-through to storage is asynchronous, and HiCache hands finished host copies
            # to its storage thread from the scheduler loop, which an idle engine does not run:
            # keep a trickle of tiny requests going until the stored bytes stop growing
            last, stable, deadline = -1, 0, time.time() + 120
            while time.time() < deadline and stable < 3:
                ttft(question()[:8])
                now = _stored_bytes(params, kind)
                stable = stable + 1 if now == last and now > 0 else 0
                last = now
                time.sleep(1)
            result["stored_bytes"] = last
        else:
            for n in lengths:
                times, hits, storage = [], [], []
                for p in prefixes[n]:
                    dt, meta = ttft(p + question())
                    times.append(dt)
                    hits.append(int(meta.get("cached_tokens", 0)))
                    storage.append(int((meta.get("cached_tokens_details") or {}).get("storage", 0)))
                result[f"ttft_{n}_ms"] = 1000 * statistics.median(times)
                result[f"ttft_{n}_ms_all"] = [round(1000 * t, 2) for t in times]
                result[f"cached_{n}"] = statistics.median(hits)
                result[f"storage_hit_{n}"] = statistics.median(storage)
    finally:
        engine.shutdown()
    return result


ENGINE_KWARGS = {**LLAMA3_8B_DUMMY, "context_length": 16384, "mem_fraction_static": 0.70,
                 "page_size": 64, "disable_cuda_graph": True}  # one output token: no decode graphs
PARAMS = {"seed": 0, "samples": 3, "question_tokens": 64, "hicache_gb": 16, "vocab": 120000,
          "lengths": list(LENGTHS)}
SMOKE_KWARGS = {"device": "cpu", "skip_tokenizer_init": True, "attention_backend": "torch_native",
                "max_total_tokens": 4096, "disable_cuda_graph": True, "page_size": 16}
SMOKE_PARAMS = {"samples": 1, "question_tokens": 8, "hicache_gb": 1, "vocab": 49000,
                "lengths": [320, 640],
                "hicache_kwargs": {"hicache_io_backend": "direct", "hicache_mem_layout": "layer_first"}}
VARIANTS = ("vanilla", "vanilla-file-writer", "vanilla-file", "sglang-pic-ptstore-writer",
            "sglang-pic-ptstore", "sglang-pic-ptstore-fastgil", "sglang-pic-ptstore-staging",
            "sglang-pic-ptstore-socket")


COLUMNS = {"recompute": "vanilla", "file": "vanilla-file", "PTStore": "sglang-pic-ptstore",
           "PTStore/fastgil": "sglang-pic-ptstore-fastgil",
           "PTStore/staging": "sglang-pic-ptstore-staging",
           "PTStore/socket": "sglang-pic-ptstore-socket"}


def plot(report: dict, out: Path) -> Path:
    """TTFT per prefix length, one bar per variant that ran (median, with the samples' range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from harness import save_figure

    res, lengths = report["results"], report["params"]["lengths"]
    shown = {c: v for c, v in COLUMNS.items() if f"ttft_{lengths[0]}_ms" in res.get(v, {})}
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / max(len(shown), 1)
    for j, (label, v) in enumerate(shown.items()):
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(lengths))]
        med = [res[v][f"ttft_{n}_ms"] for n in lengths]
        # the samples are rounded to 0.01 ms, the median is not: clamp the rounding away
        lo = [max(0.0, m - min(res[v][f"ttft_{n}_ms_all"])) for m, n in zip(med, lengths,
                                                                               strict=True)]
        hi = [max(0.0, max(res[v][f"ttft_{n}_ms_all"]) - m) for m, n in zip(med, lengths,
                                                                               strict=True)]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=label)
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" for n in lengths])
    ax.set_xlabel("prefix computed by the other instance (tokens)")
    ax.set_ylabel("TTFT (ms)")
    env = report.get("environment", {})
    ax.set_title(f"TTFT of a stored prefix, Llama-3-8B shape, {env.get('gpu', 'CPU')}, "
                 f"SGLang {env.get('sglang', '')}", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def print_table(report: dict) -> None:
    res, lengths = report["results"], report["params"]["lengths"]
    print(f"\n{'prefix':>8}" + "".join(f"{c:>16}" for c in COLUMNS)
          + f"{'PTStore vs recompute':>22}{'vs file':>10}")
    for n in lengths:
        ms = {c: res.get(v, {}).get(f"ttft_{n}_ms") for c, v in COLUMNS.items()}
        cells = "".join(f"{m:>14.1f}ms" if m else f"{'-':>16}" for m in ms.values())
        rec, fil, pts = ms["recompute"], ms["file"], ms["PTStore"]
        ratio = f"{rec / pts:>21.2f}x" if rec and pts else f"{'-':>22}"
        vs_file = f"{fil / pts:>9.2f}x" if fil and pts else f"{'-':>10}"
        print(f"{n:>8}{cells}{ratio}{vs_file}")


def main() -> None:
    from harness import run_side_by_side, smoke_dir, start_store_servers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replot", default=None, help="table and plot of a report JSON, no run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--samples", type=int, default=PARAMS["samples"])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--stores", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, SmolLM2, tiny prefixes")
    args = ap.parse_args()
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        print_table(report)
        plot(report, REPO / "docs" / "figures" / f"{Path(args.replot).stem}.png")
        return
    kwargs, extra, name = ENGINE_KWARGS, {}, "store_ttft_h200"
    if args.smoke:
        sys.path.insert(0, str(REPO / "python"))
        from sglang_pic.cpu_support import enable_cpu_engine
        from sglang_pic.default_model import ensure_default_model

        enable_cpu_engine()
        kwargs = {"model_path": str(ensure_default_model()), **SMOKE_KWARGS}
        extra, name = SMOKE_PARAMS, "store_ttft_cpu_smoke"
        args.out = args.out or smoke_dir()
    token = "bench-store-ttft-token"  # a throwaway token of loopback servers
    stores, endpoints = start_store_servers(args.stores, token, memory_gb=16)
    try:
        with tempfile.TemporaryDirectory() as file_dir:
            params = {**PARAMS, "samples": args.samples, **extra, "servers": endpoints,
                      "token": token, "file_dir": file_dir}
            report = run_side_by_side(name, "store.bench_store_ttft", "workload", kwargs, params, variants=tuple(args.variants.split(",")),
                                      out_dir=args.out, timeout_s=900)
    finally:
        for p in stores:
            p.terminate()
    print_table(report)
    figures = Path(args.out) if args.smoke else REPO / "docs" / "figures"
    plot(report, figures / f"{name}.png")


if __name__ == "__main__":
    main()
