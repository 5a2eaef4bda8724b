"""Quality of sparse decoding with real weights: needle / RULER-style cases inside SmolLM2's 8K
context, decoded sparsely (ParisKV) and densely by SGLang in the same run.

Dummy weights give flat logits, so identical tokens there prove nothing about accuracy. This run
uses SmolLM2-135M-Instruct, the embedded default model, converted once from its GGUF
(``sglang_pic.launcher.default_model``; what ``real_weights.py`` runs), in bf16 on the H200:

- the cases: ``bench_ruler.make_task``'s one-needle and four-needle tasks (a 7-digit "special
  magic number" for a key, hidden at a random depth of a filler haystack; asked for one of them),
  ``--cases`` per task and length (default 60 x 2 tasks = 120 per length) at prompts of about
  2K, 4K and 8K tokens (SmolLM2's context is 8192), all generated from fixed seeds;
- ``vanilla``: SGLang 0.5.17 on FlashInfer, dense (the headline baseline);
- ``sglang-pic-sparse``: ``pariskv_triton`` (``--sparse-decode pariskv``) with the threshold
  lowered to ``--threshold`` (1024) tokens so that every case decodes sparsely: sink
  ``--sink`` + local window ``--local`` attended densely, ``--topk`` keys retrieved per KV head
  and step from the rest (``--candidates`` kept by voting for the rerank). ``max_requests`` is
  also SGLang's ``max_running_requests``, so no long request falls back to dense for lack of a
  slot (with prometheus_client installed the run records SGLang's sparse counters to show it);
- ``sglang-pic-sparse-r<N>`` (when listed in ``--variants``): the same sparse server with
  ``--sparse-reselect-interval N``, each selection serving N decode steps;
- ``sglang-pic-dense``: our plugin loaded, SGLang's triton backend, dense (the kernels the sparse
  server uses for everything it does not decode sparsely): a column that separates what sparse
  decoding changes from what FlashInfer vs triton changes. Not a headline, so it runs last and
  only when the first two finished within ``--budget-s`` (one device call has 10 minutes).

Every variant gets all cases at once (one batched ``generate``: SGLang schedules them
concurrently), greedy, ``--new-tokens`` tokens. A case is solved when its answer's digits appear
in the generated text (commas removed), as in ``bench_ruler.py``. Score = % of the cases of a
length solved (0-100), per variant.

Recall: the parent then runs the HF model (float32, on the GPU; CPU for ``--cpu``) over
``--recall-prompts`` cases per length, captures every layer's post-RoPE queries and keys, and at
the last prompt position (the query of the first decode step) measures recall@``topk`` of the
selection the server makes - ``KernelIndexOps`` (the Triton kernels) on the GPU,
``TorchIndexOps`` on CPU; per KV head, the group's query heads together - against the exact
top-``topk`` of ``max over the group of q.k`` over the retrieval region (positions
``[sink, n - local)``).

Writes ``sparse_quality_h200.json`` (``sparse_quality_cpu_smoke.json`` with ``--smoke``) into
``--out`` (default ``benchmark/results``): machine, versions, engine settings, every case's
prompt length, answer and each variant's text, scores per length, recall per length and layer.
Each variant's results carry ``score_<2k|4k|8k>_all``, one 0/100 per case, which
``benchmark/headlines.py`` reads for the rows ``sparse.quality.<2k|4k|8k>``.

    python3 -m benchmark.quality.sparse_needle --out DIR       # device, one call (<= 8 min)
    .venv/bin/python -m benchmark.quality.sparse_needle --cpu --smoke   # here: 2K, 2 cases/task
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from benchmark import description

CONTEXT = 8192  # SmolLM2-135M's context length
LENGTHS = {"2k": 2048, "4k": 4096, "8k": 8192}  # nominal prompt lengths
TASKS = ("niah_single", "niah_multikey")
QUESTION_ROOM = 64  # the haystack's tokens are this far below the nominal length
VARIANTS = ("vanilla", "sglang-pic-sparse", "sglang-pic-dense")


def build_cases(
    tok, lengths: list[str], tasks: tuple[str, ...], per_task: int, new_tokens: int
) -> list[dict]:
    """Every case as ``{length, task, index, input_ids, answer}``, from fixed seeds; a prompt
    whose tokens would not leave room for the answer within the context is rebuilt shorter."""
    from benchmark.sparse.bench_ruler import make_task

    cases = []
    for name in lengths:
        for task in tasks:
            rng = random.Random(f"sparse-needle-{task}-{name}")
            for i in range(per_task):
                haystack = LENGTHS[name] - QUESTION_ROOM
                while True:
                    state = rng.getstate()
                    prompt, answer = make_task(task, tok, haystack, rng)
                    ids = tok(prompt)["input_ids"]
                    if len(ids) + new_tokens < CONTEXT:
                        break
                    rng.setstate(state)  # the same draw, a shorter haystack
                    haystack -= 64
                cases.append(
                    {"length": name, "task": task, "index": i, "input_ids": ids, "answer": answer}
                )
    return cases


def solved(answer: str, text: str) -> bool:
    """``bench_ruler.py``'s rule: the answer's digits appear in the generated text."""
    return answer in text.replace(",", "")


def _sparse_counters() -> dict[str, float]:
    """SGLang's sparse counters (``sglang_pic.sparse.metrics``) summed over the engine's
    processes, from prometheus_client's multiprocess files (``--enable-metrics``)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    counters: dict[str, float] = {}
    for metric in registry.collect():
        if metric.name.startswith("sglang_pic:sparse_"):
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
    return counters


def workload(engine_kwargs: dict, params: dict) -> dict:
    """Runs in the variant's process: one Engine, every case in one batched generate."""
    import sglang as sgl

    variant = os.environ.get("SGLANG_PIC_BENCH_VARIANT", "vanilla")
    for key, value in params["sparse_env"].items():  # read by our backend; vanilla ignores them
        os.environ[key] = str(value)
    t0 = time.perf_counter()
    engine = sgl.Engine(**engine_kwargs)
    out: dict = {"variant": variant, "engine_start_s": time.perf_counter() - t0}
    sp = {"temperature": 0, "max_new_tokens": params["new_tokens"],
          "ignore_eos": params.get("ignore_eos", False)}
    try:
        t = time.perf_counter()
        res = engine.generate(input_ids=params["prompts"], sampling_params=sp)
        out["generate_s"] = time.perf_counter() - t
        out["texts"] = [r["text"] for r in res]
        out["output_ids"] = [r["output_ids"] for r in res]
        out["sparse_counters"] = None
        if engine_kwargs.get("enable_metrics"):
            try:
                out["sparse_counters"] = _sparse_counters()
            except Exception as e:  # the scores stand without them
                out["sparse_counters"] = {"error": repr(e)}
    finally:
        engine.shutdown()
    return out


SPARSE_KNOBS = ("threshold", "topk", "candidates", "sink", "local", "update", "max_requests")


def add_sparse_knobs(ap: argparse.ArgumentParser) -> None:
    """The sparse server's settings (``SPARSE_KNOBS``): every case decodes sparsely inside
    SmolLM2's 8K context."""
    ap.add_argument("--threshold", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--candidates", type=int, default=4096,
                    help="kept by voting for the rerank (the server's default)")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--local", type=int, default=128)
    ap.add_argument("--update", type=int, default=64)
    ap.add_argument("--max-requests", type=int, default=64,
                    help="sparse slots, and SGLang's --max-running-requests")


def engine_settings(model_dir: str, cpu: bool, max_requests: int, metrics: bool = False
                    ) -> tuple[dict, dict[str, dict]]:
    """The engines' kwargs (vanilla's: dense FlashInfer, or torch_native on CPU) and each of our
    variants' overrides (``sglang-pic-sparse``, ``sglang-pic-dense``)."""
    common = {"model_path": model_dir, "dtype": "bfloat16", "page_size": 1,
              "max_running_requests": max_requests, "enable_metrics": metrics,
              "log_level": "warning"}
    if cpu:
        from sglang_pic.cpu.support import enable_cpu_engine

        enable_cpu_engine()
        return ({**common, "device": "cpu", "attention_backend": "torch_native",
                 "max_total_tokens": 4 * CONTEXT, "disable_cuda_graph": True},
                {"sglang-pic-dense": {"attention_backend": "torch_native"},
                 "sglang-pic-sparse": {"attention_backend": "pariskv_torch_native"}})
    return ({**common, "attention_backend": "flashinfer", "mem_fraction_static": 0.5,
             "cuda_graph_max_bs_decode": max_requests},
            {"sglang-pic-dense": {"attention_backend": "triton"},
             "sglang-pic-sparse": {"attention_backend": "pariskv_triton"}})


def add_reselect_variants(variants: tuple[str, ...], ours: dict[str, dict]) -> None:
    """``sglang-pic-sparse-r<N>`` and ``-v<N>`` variants get the sparse engine's kwargs in
    ``ours`` (the harness sets their reselect or vote interval); any other name must be a known
    variant."""
    from benchmark.harness import sparse_variant_kwargs

    ours.update(sparse_variant_kwargs(variants, {"sglang-pic-sparse": ours["sglang-pic-sparse"]},
                                      others=("vanilla", "sglang-pic-dense")))


def scores(cases: list[dict], texts: list[str]) -> dict[str, list[float]]:
    """Per length, one 0/100 per case (solved or not), in case order."""
    per: dict[str, list[float]] = {}
    for case, text in zip(cases, texts, strict=True):
        per.setdefault(case["length"], []).append(100.0 if solved(case["answer"], text) else 0.0)
    return per


def capture_qk(model, ids: list[int], device: str) -> list[tuple]:
    """Per layer, the post-RoPE query of the last position ``[q_heads, D]`` and every key
    ``[n, kv_heads, D]`` (``bench_recall.capture_qkv``)."""
    from benchmark.sparse.bench_recall import capture_qkv

    captured = capture_qkv(model, ids, device)
    return [(q[:, -1], k.transpose(0, 1)) for _, (q, k, _v) in sorted(captured.items())]


def selection_recall(ops, per_layer: list[tuple], knobs: dict, device: str) -> list[float]:
    """Per layer, recall@topk of the server's selection (its index ops ``ops``, slot 0; the
    group's query heads together) against the exact top-topk of ``max over the group of q.k``
    over the retrieval region ``[sink, n - local)``, averaged over KV heads."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the server's KV pool's
    sink, local, topk = knobs["sink"], knobs["local"], knobs["topk"]
    out = []
    for layer, (q, k) in enumerate(per_layer):
        n, hkv, d = k.shape
        n_ret = n - sink - local
        region = k[sink : sink + n_ret]  # [n_ret, kv_heads, D]
        ops.encode(layer, 0, region.to(dtype).contiguous(), 0)
        n_ret_t = torch.tensor([n_ret], dtype=torch.int32, device=device)
        slot_row = torch.zeros(1, dtype=torch.int64, device=device)
        rows = ops.select(layer, q[None].to(dtype), slot_row, n_ret_t)[0]  # [kv_heads, topk]
        qg = q.float().view(hkv, -1, d)
        exact = torch.einsum("hgd,nhd->hgn", qg, region.float()).amax(1).topk(topk, -1).indices
        hits = [len(set(rows[h].tolist()) & set(exact[h].tolist())) / topk for h in range(hkv)]
        out.append(sum(hits) / hkv)
    return out


def recall_report(
    model_dir: str, cases: list[dict], per_length: int, knobs: dict, device: str
) -> dict:
    """Recall of the selection on ``per_length`` cases of each length, spread over its cases."""
    import torch
    from sglang_pic.sparse.index_ops import KernelIndexOps, TorchIndexOps
    from transformers import AutoModelForCausalLM

    ops_cls = KernelIndexOps if device == "cuda" else TorchIndexOps
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    report: dict = {"per_length": {}, "by_layer": {}, "prompts": {}}
    for name in dict.fromkeys(c["length"] for c in cases):
        of_length = [c for c in cases if c["length"] == name]
        picked = of_length[:: max(1, len(of_length) // per_length)][:per_length]
        capacity = max(len(c["input_ids"]) for c in picked) - knobs["sink"] - knobs["local"]
        attended = knobs["sink"] + knobs["topk"] + knobs["local"] + knobs["update"]
        ops = ops_cls(
            cfg.num_hidden_layers,
            1,
            hq,
            hkv,
            d,
            capacity,
            knobs["topk"],
            knobs["candidates"],
            attended,
            device,
        )
        layers = [
            selection_recall(ops, capture_qk(model, c["input_ids"], device), knobs, device)
            for c in picked
        ]
        by_layer = [sum(col) / len(col) for col in zip(*layers, strict=True)]
        report["per_length"][name] = sum(by_layer) / len(by_layer)
        report["by_layer"][name] = by_layer
        report["prompts"][name] = [
            {"task": c["task"], "index": c["index"], "tokens": len(c["input_ids"])} for c in picked
        ]
        del ops
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return report


def main() -> None:
    import importlib.util
    import tempfile

    from sglang_pic.launcher.default_model import ensure_default_model
    from transformers import AutoTokenizer

    from benchmark.harness import RESULTS, environment, ratio_table, run_side_by_side, smoke_dir

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None, help="default benchmark/results")
    ap.add_argument("--lengths", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    ap.add_argument("--cases", type=int, default=60, help="cases per task and length")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--budget-s",
        type=float,
        default=300,
        help="run sglang-pic-dense (not a headline) only if the others finished within this",
    )
    add_sparse_knobs(ap)
    ap.add_argument("--recall-prompts", type=int, default=4, help="per length (0: no recall)")
    ap.add_argument("--cpu", action="store_true", help="SGLang's CPU engine (torch_native)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="2K only, 2 cases per task, 1 recall prompt; writes under $TMPDIR",
    )
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.cases, args.recall_prompts = ["2k"], 2, 1
        args.max_requests = min(args.max_requests, 4)
        args.out = args.out or smoke_dir()
    t_start = time.perf_counter()
    model_dir = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    cases = build_cases(tok, args.lengths, TASKS, args.cases, args.new_tokens)
    knobs = {k: getattr(args, k) for k in SPARSE_KNOBS}
    sparse_env = {f"SGLANG_PIC_SPARSE_{k.upper()}": v for k, v in knobs.items()}
    # SGLang's counters need prometheus_client, which the device kit may lack
    metrics = importlib.util.find_spec("prometheus_client") is not None
    engine_kwargs, ours = engine_settings(model_dir, args.cpu, args.max_requests, metrics)
    variants = tuple(args.variants.split(","))
    try:
        add_reselect_variants(variants, ours)
    except ValueError as e:
        ap.error(str(e))
    name = (
        "sparse_quality_cpu_smoke"
        if args.smoke
        else "sparse_quality_cpu"
        if args.cpu
        else "sparse_quality_h200"
    )
    params = {
        "prompts": [c["input_ids"] for c in cases],
        "new_tokens": args.new_tokens,
        "sparse_env": sparse_env,
    }

    def run(label: str, which: tuple[str, ...], out_dir: str | None) -> dict:
        return run_side_by_side(
            label,
            "quality.sparse_needle",
            "workload",
            engine_kwargs,
            params,
            variants=which,
            out_dir=out_dir,
            variant_kwargs={v: ours[v] for v in which if v in ours},
            # a fresh device machine compiles FlashInfer's kernels for this model's shape
            # during the first engine's graph capture (132 s on the H200) unless its JIT cache
            # was staged (scripts/device_step.sh jit-part)
            timeout_s=1800 if args.cpu else 400,
        )

    # the headline pair first; the dense triton column after it, when time is left
    extra = tuple(v for v in variants if v == "sglang-pic-dense")
    report = run(name, tuple(v for v in variants if v not in extra), args.out)
    res = report["results"]
    skipped = {}
    for variant in extra:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            skipped[variant] = f"not run: {elapsed:.0f} s used, --budget-s {args.budget_s:g}"
            continue
        res.update(run(f"{name}_{variant}", (variant,), tempfile.mkdtemp())["results"])
    variants = tuple(v for v in variants if v in res)
    lengths = {n: LENGTHS[n] for n in args.lengths}
    tokens = {
        n: [
            min(len(c["input_ids"]) for c in cases if c["length"] == n),
            max(len(c["input_ids"]) for c in cases if c["length"] == n),
        ]
        for n in lengths
    }
    report["params"] = {
        "prompts": f"{len(cases)} prompts, in 'cases'",
        "new_tokens": args.new_tokens,
        "sparse_env": sparse_env,
    }
    report["config"] = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> bf16)",
        "tasks": TASKS,
        "lengths": lengths,
        "prompt_tokens_min_max": tokens,
        "cases_per_task_and_length": args.cases,
        "sparse": knobs,
        "sparse_counters": "SGLang's /metrics counters"
        if metrics
        else "unavailable "
        "(no prometheus_client): max_requests slots for as many running requests and a "
        "region of the whole context leave no long request dense",
        "scoring": "answer digits in the generated text (commas removed)",
        "skipped_variants": skipped,
    }
    summary: dict = {}
    for variant in variants:
        result = res[variant]
        for length, values in scores(cases, result["texts"]).items():
            result[f"score_{length}_all"] = values
            result[f"score_{length}"] = sum(values) / len(values)
            summary.setdefault(length, {})[variant] = result[f"score_{length}"]
        result.pop("output_ids", None)
    report["summary"] = summary
    report["ratios"] = ratio_table(res, {f"score_{n}" for n in lengths})
    report["cases"] = [
        {
            "length": c["length"],
            "task": c["task"],
            "index": c["index"],
            "tokens": len(c["input_ids"]),
            "answer": c["answer"],
            **{v: res[v]["texts"][i] for v in variants},
        }
        for i, c in enumerate(cases)
    ]
    for variant in variants:
        res[variant].pop("texts")
    device = "cpu" if args.cpu else "cuda"
    t = time.perf_counter()
    report["recall"] = (recall_report(model_dir, cases, args.recall_prompts, knobs, device)
                        if args.recall_prompts > 0 else None)  # --recall-prompts 0: none
    if report["recall"] is not None:
        report["recall"]["seconds"] = time.perf_counter() - t
    report["environment"] = environment()
    report["wall_s"] = time.perf_counter() - t_start
    folder = Path(args.out) if args.out else RESULTS
    path = folder / f"{name}.json"
    path.write_text(json.dumps(report, indent=1))
    print(
        f"\n{'length':>7}{'cases':>7}{'tokens':>12}"
        + "".join(f"{v:>20}" for v in variants)
        + f"{'recall@' + str(args.topk):>12}"
    )
    for length in lengths:
        n = sum(c["length"] == length for c in cases)
        span = "-".join(str(x) for x in tokens[length])
        print(
            f"{length:>7}{n:>7}{span:>12}"
            + "".join(f"{summary[length][v]:>20.1f}" for v in variants)
            + (f"{report['recall']['per_length'][length]:>12.3f}" if report["recall"]
               else f"{'-':>12}")
        )
    for variant in (v for v in variants if v.startswith("sglang-pic-sparse")):
        print(f"{variant} counters: {res[variant].get('sparse_counters')}")
    for variant, why in skipped.items():
        print(f"{variant}: {why}")
    print(f"wrote {path} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
