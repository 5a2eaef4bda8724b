"""End-to-end decode (TPOT) of SGLang with ParisKV sparse decoding vs vanilla SGLang, same run.

Engines one after the other, each in its own process (``harness.run_side_by_side``):
``vanilla`` (SGLang 0.5.17 on FlashInfer, the baseline; ``vanilla-triton`` on its triton
backend), ``sglang-pic`` (``pariskv_triton``: SGLang's triton backend for prefill and short
requests, ParisKV for the decode of requests over ``--threshold`` tokens) and
``sglang-pic-flashinfer`` (``pariskv_flashinfer``: the same on SGLang's FlashInfer backend).
Llama-3-8B shape, dummy weights, bf16, decode CUDA graphs on (SGLang's default; the sparse part
is captured in them).

Per case (batch ``b`` prompts of ``n`` random tokens): the prompts are prefilled once (so the
radix cache holds them), then generated again with 17 and with 145 new tokens (``ignore_eos``);
TPOT = (t145 - t17) / 128, so prefill (one token: the prompt is cached), the sparse activation
(both generations find the region encoded by the case's first decode) and the scheduler's
start-up cost cancel out. ``first_decode_extra_s_<case>``: that first decode's time less a later
17-token generation's, i.e. the cold activation (encoding every region) plus first-use
compiles. A case below the threshold measures what the sparse backend costs requests that stay
dense.

    python3 -m benchmark.sparse.bench_e2e_decode [--cases 1x4096,1x131072,1x262144,4x65536]
                                                 (a case "1x131072+7x4096" mixes lengths)
                                                 [--variants vanilla,sglang-pic] [--out DIR]

Prints a table; writes ``sparse_e2e_decode.json`` (machine, versions, config, ratios) and a plot
into ``--out`` (default ``benchmark/results``).

``--profile-steps N`` ends each case with N decode steps under SGLang's torch profiler (GPU
activity; kernels inside CUDA graphs are recorded one by one) and stores, per variant and case,
the GPU time per step by kernel and the step's GPU-idle time (wall per step minus the union of
kernel intervals): where a step's time goes that the TPOT alone does not show. With
``--profile-cpu`` the CPU side too: CUDA runtime calls (launches, copies, synchronisations)
and operators per step. The traces stay in ``--profile-dir`` (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmark import description
from benchmark.harness import (
    LLAMA3_8B_DUMMY,
    RESULTS,
    combine_reports,
    print_table,
    ratio_table,
    reselect_variant,
    run_settings,
    run_side_by_side,
    save_figure,
    sparse_variant_kwargs,
)

SHORT, LONG = 17, 145


def start_engine(engine_kwargs: dict, sparse_env: dict):
    """An Engine with the sparse knobs in its environment (vanilla's ignores them); returns it
    and ``{"engine_start_s": ...}``."""
    import sglang as sgl

    os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    for k, v in sparse_env.items():
        os.environ[k] = str(v)
    t0 = time.perf_counter()
    engine = sgl.Engine(**engine_kwargs)
    return engine, {"engine_start_s": time.perf_counter() - t0}


def workload(engine_kwargs: dict, params: dict) -> dict:
    """Runs in the variant's process: one Engine, every case."""
    import numpy as np
    import torch

    engine, out = start_engine(engine_kwargs, params["sparse_env"])
    free, total = torch.cuda.mem_get_info()
    out["gpu_used_gib_after_start"] = (total - free) / 2**30
    rng = np.random.default_rng(params["seed"])
    try:
        for case in params["cases"]:
            prompts = [[int(t) for t in rng.integers(1000, params["vocab"], size=n)]
                       for n in case_lengths(case)]
            t = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1})
            out[f"prefill_s_{case}"] = time.perf_counter() - t
            # one decode of the case outside the TPOT samples first: whatever runs once per
            # shape (kernel compilation, the sparse activation's encode of each region) must not
            # land in one timed run and not the other; later generations of the same prompts
            # find their regions encoded (``decode_state``'s region reuse)
            t = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": SHORT,
                                                                "ignore_eos": True})
            first_short = time.perf_counter() - t
            tpots, ids, shorts = [], None, []
            for _ in range(params["repeats"]):
                times = {}
                for new in (SHORT, LONG):
                    sp = {"max_new_tokens": new, "ignore_eos": True, "temperature": 0}
                    t = time.perf_counter()
                    res = engine.generate(input_ids=prompts, sampling_params=sp)
                    times[new] = time.perf_counter() - t
                ids = res[0]["output_ids"]
                tpots.append((times[LONG] - times[SHORT]) / (LONG - SHORT) * 1e3)
                shorts.append(times[SHORT])
            # the first decode's extra time: the activation (sparse: encoding every region from
            # scratch; later requests on the same prompts reuse it) and first-use compiles
            out[f"first_decode_extra_s_{case}"] = first_short - statistics.median(shorts)
            out[f"tpot_ms_{case}"] = statistics.median(tpots)
            # ``_all``: the harness pools these over rounds (``merge_rounds``)
            out[f"tpot_ms_{case}_all"] = [round(x, 3) for x in tpots]
            out[f"tokens_per_s_{case}"] = len(prompts) * 1e3 / out[f"tpot_ms_{case}"]
            out[f"output_ids_{case}"] = ids
            print(f"[bench] {case}: TPOT {out[f'tpot_ms_{case}']:.2f} ms "
                  f"(samples {', '.join(f'{x:.2f}' for x in tpots)})", flush=True)
            if params.get("profile_steps"):
                out[f"profile_{case}"] = profile_decode(
                    engine, prompts, f"{engine_kwargs['attention_backend']}_{case}", params)
    finally:
        engine.shutdown()
    return out


def profile_decode(engine, prompts: list, tag: str, params: dict) -> dict:
    """``params["profile_steps"]`` decode steps of ``prompts`` under SGLang's profiler (the
    case ran before: nothing compiles); returns ``kernel_summary`` of the trace it writes into
    a folder named ``tag``."""
    steps = params["profile_steps"]
    out_dir = Path(params["profile_dir"]) / tag
    out_dir.mkdir(parents=True, exist_ok=True)
    # by stage: the prompt's extend (one token, the prompt is cached) gets a trace of its own,
    # the decode steps theirs; the first decode step holds the sparse activation (the region
    # found encoded, or encoded again), which ``kernel_summary`` reports apart
    activities = ["CPU", "GPU"] if params.get("profile_cpu") else ["GPU"]
    engine.start_profile(output_dir=str(out_dir), num_steps=steps, activities=activities,
                         profile_id=tag.replace("+", "_"), profile_by_stage=True,
                         with_stack=False, record_shapes=False)
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": steps + 8,
                                                        "ignore_eos": True, "temperature": 0})
    wall = time.perf_counter() - t
    deadline = time.time() + 120  # the scheduler writes the trace after its last step
    while time.time() < deadline and not list(out_dir.glob("*DECODE*.trace.json.gz")):
        time.sleep(0.5)
    traces = sorted(out_dir.glob("*DECODE*.trace.json.gz"))
    if not traces:
        return {"error": f"no trace in {out_dir} after 120 s", "wall_s": wall}
    summary = kernel_summary(traces[-1], steps)
    summary["trace"] = str(traces[-1])
    steady = summary.get("steady")
    shown = steady if steady and "error" not in steady else summary
    top = list(shown["us_per_step_by_kernel"].items())[:12]  # sorted, longest first
    first = (f" after a first step of {summary['first_step_us'] / 1e3:.1f} ms"
             if shown is not summary else "")
    print(f"[bench] {tag} profile: {shown['kernel_us_per_step']:.0f} us of kernels and "
          f"{shown['gpu_idle_us_per_step']:.0f} us GPU idle per step{first}; top kernels: "
          + ", ".join(f"{k[:40]} {v:.0f}" for k, v in top), flush=True)
    return summary


def kernel_summary(trace: Path, steps: int) -> dict:
    """GPU kernels of a chrome trace (``cat`` "kernel"): microseconds per step by kernel name
    (names cut at 80 characters), in total, and the time within the kernels' overall span
    when no kernel ran (launch gaps, waits on the CPU), each divided by ``steps``.

    Where the trace marks SGLang's decode steps on the GPU (``gpu_user_annotation``
    "step[DECODE ..."), ``first_step_us`` is the first one's length and ``steady`` the same
    summary over the later steps only: a new request's first decode step holds the sparse
    activation (encoding the retrieval region, hundreds of ms at 128K), which the totals
    spread over every step."""
    with gzip.open(trace, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e),
                     key=lambda e: e["ts"])
    if not kernels:
        return {"error": "no kernel events in the trace", "steps": steps}
    out = _window_summary(events, kernels, steps)
    marks = sorted((e for e in events if e.get("cat") == "gpu_user_annotation" and "dur" in e
                    and e.get("name", "").startswith("step[DECODE")), key=lambda e: e["ts"])
    if len(marks) >= 2:
        lo, hi = marks[1]["ts"], marks[-1]["ts"] + marks[-1]["dur"]
        inside = [e for e in kernels if lo <= e["ts"] < hi]
        host = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op")
                and lo <= e.get("ts", -1) < hi]
        out["first_step_us"] = marks[0]["dur"]
        out["steady"] = (_window_summary(host, inside, len(marks) - 1) if inside
                         else {"error": "no kernels after the first step"})
    return out


def _window_summary(events: list[dict], kernels: list[dict], steps: int) -> dict:
    """``kernel_summary``'s figures for ``kernels`` (sorted by start, not empty) and the host
    events among ``events``, per step of ``steps``."""
    by_name: dict[str, float] = {}
    busy, end = 0.0, None
    for e in kernels:
        name = e["name"][:80]
        by_name[name] = by_name.get(name, 0.0) + e["dur"]
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is None or s >= end:
            busy += e["dur"]
            end = t
        elif t > end:
            busy += t - end
            end = t
    span = end - kernels[0]["ts"]
    # with CPU activity: CUDA runtime calls (launches, copies, waits) and operators, per step
    host: dict[str, dict[str, float]] = {"cuda_runtime": {}, "cpu_op": {}}
    for e in events:
        cat = "cuda_runtime" if e.get("cat") in ("cuda_runtime", "cuda_driver") else e.get("cat")
        if cat in host and "dur" in e:
            name = e.get("name", "?")[:80]
            host[cat][name] = host[cat].get(name, 0.0) + e["dur"]
    host_top = {f"{cat}_us_per_step": {k: round(v / steps, 2) for k, v in
                                       sorted(d.items(), key=lambda kv: -kv[1])[:25]}
                for cat, d in host.items() if d}
    return {"steps": steps, "kernels": len(kernels), **host_top,
            "kernel_us_per_step": sum(by_name.values()) / steps,
            "busy_us_per_step": busy / steps, "span_us_per_step": span / steps,
            "gpu_idle_us_per_step": (span - busy) / steps,
            "us_per_step_by_kernel": {k: round(v / steps, 2) for k, v in
                                      sorted(by_name.items(), key=lambda kv: -kv[1])}}


def case_lengths(case: str) -> list[int]:
    """Prompt lengths of a case: ``BxN`` is B prompts of N tokens; ``+`` joins groups into one
    batch (``1x262144+7x4096``: a long request decoding beside seven short ones)."""
    lengths = []
    for group in case.split("+"):
        b, n = (int(x) for x in group.split("x"))
        lengths += [n] * b
    return lengths


LABELS = {"vanilla": "vanilla SGLang (dense FlashInfer)",
          "vanilla-triton": "vanilla SGLang (dense triton)",
          "sglang-pic": "sglang-pic pariskv_triton",
          "sglang-pic-flashinfer": "sglang-pic pariskv_flashinfer"}
SPARSE_VARIANTS = ("sglang-pic", "sglang-pic-flashinfer")


def variant_label(variant: str) -> str:
    reselect = reselect_variant(variant)
    if reselect:
        what = "a selection" if reselect[2] == "reselect_interval" else "a vote (reranked between)"
        return f"{LABELS[reselect[0]]}, {what} every {reselect[1]} steps"
    return LABELS[variant]


def plot(report: dict, out_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    cases = report["params"]["cases"]
    fig, ax = plt.subplots(figsize=(7, 4))
    shown = [v for v in [*LABELS, *(v for v in res if reselect_variant(v))]
             if v in res and "error" not in res[v]]
    width = 0.8 / max(len(shown), 1)
    for i, variant in enumerate(shown):
        ys = [res[variant].get(f"tpot_ms_{c}", 0) for c in cases]
        xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(cases))]
        ax.bar(xs, ys, width, label=variant_label(variant))
    ax.set_xticks(range(len(cases)), [c.replace("x", " x ") for c in cases])
    ax.set_xlabel("batch x context tokens")
    ax.set_ylabel("TPOT (ms)")
    gpu = report.get("environment", {}).get("gpu") or "GPU"
    ax.set_title(f"Decode TPOT, Llama-3-8B shape (dummy weights, bf16, CUDA graphs), {gpu}",
                 fontsize=9)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.35)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper left")
    return save_figure(fig, out_dir / "sparse_e2e_decode.png")


def _merge_earlier(report: dict, prev: Path) -> dict:
    """Add the results of variants this call did not run from an earlier report of the same
    cases and settings (the variants can then run in separate device calls, each under its
    time limit); the ratios are recomputed, the file rewritten."""
    if not prev.exists():
        return report
    old = json.loads(prev.read_text())
    prev.unlink()
    if run_settings(old) != run_settings(report):
        print(f"[bench] {prev} is of other cases or settings: not merged", flush=True)
        return report
    for variant, result in old.get("results", {}).items():
        if variant not in report["results"]:  # a failed variant stops the run (harness)
            report["results"][variant] = result
            report.setdefault("merged_from_earlier_call", []).append(
                {"variant": variant, "environment": old.get("environment")})
    higher = {r["metric"] for r in report.get("ratios", []) if r["better"] == "higher"}
    higher |= {f"tokens_per_s_{c}" for c in report["params"]["cases"]}
    report["ratios"] = ratio_table(report["results"], higher)
    print_table(report["ratios"])
    (prev.parent / "sparse_e2e_decode.json").write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--cases", default="1x4096,1x131072,1x262144,4x65536")
    ap.add_argument("--variants", default="vanilla,sglang-pic",
                    help="of vanilla, vanilla-triton, sglang-pic (pariskv_triton), "
                         "sglang-pic-flashinfer (pariskv_flashinfer); a sparse one with -r<N> "
                         "(sglang-pic-flashinfer-r4) runs --sparse-reselect-interval N")
    ap.add_argument("--threshold", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--candidates", type=int, default=4096)
    ap.add_argument("--max-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="TPOT samples per case and round")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times, alternating which goes first; "
                         "samples are pooled over rounds")
    ap.add_argument("--resume-from", default=None, metavar="REPORT",
                    help="an earlier call's report of the same cases and settings: this call's "
                         "rounds continue its alternation and pool their samples with it")
    ap.add_argument("--mem-fraction", type=float, default=0.55)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after each case's samples, profile this many decode steps (0: none)")
    ap.add_argument("--profile-cpu", action="store_true",
                    help="profile CPU activity too (runtime calls, operators per step)")
    ap.add_argument("--profile-dir", default=None,
                    help="where the traces go (default: a temporary folder)")
    ap.add_argument("--combine", nargs="+", default=None, metavar="REPORT",
                    help="write one report from complete reports of the same cases and "
                         "settings, each a device call that ran some of the variants (samples "
                         "of a variant in several are pooled); runs nothing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.combine:
        try:
            report = combine_reports([Path(p) for p in args.combine])
        except (ValueError, OSError, KeyError) as e:
            ap.error(f"--combine: {e}")
        out_dir = Path(args.out) if args.out else RESULTS
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "sparse_e2e_decode.json"
        path.write_text(json.dumps(report, indent=2))
        print_table(report["ratios"])
        print_speedups(report)
        print(f"[bench] wrote {path}")
        plot(report, out_dir)
        return
    if args.repeats < 1 or args.rounds < 1:
        ap.error("--repeats and --rounds must be at least 1")
    if not 0 <= args.profile_steps <= 256:
        ap.error("--profile-steps must be in [0, 256]")
    # checked before anything is written or moved
    variants = tuple(args.variants.split(","))
    try:
        variant_kwargs = sparse_variant_kwargs(
            variants, {"sglang-pic": {"attention_backend": "pariskv_triton"},
                       "sglang-pic-flashinfer": {"attention_backend": "pariskv_flashinfer"}},
            others=("vanilla", "vanilla-triton"))
    except ValueError as e:
        ap.error(str(e))
    cases = args.cases.split(",")
    out_dir = Path(args.out) if args.out else RESULTS
    earlier = out_dir / "sparse_e2e_decode.json"
    if earlier.exists():  # kept for _merge_earlier: variants may run in separate calls
        earlier.replace(out_dir / "sparse_e2e_decode.json.prev")
    longest = max(max(case_lengths(c)) for c in cases)
    context = longest + LONG + 64
    engine_kwargs = {**LLAMA3_8B_DUMMY, "context_length": context,
                     "mem_fraction_static": args.mem_fraction, "cuda_graph_max_bs_decode": 8,
                     "max_running_requests": 8, "chunked_prefill_size": 16384}
    sparse_env = {"SGLANG_PIC_SPARSE_THRESHOLD": args.threshold,
                  "SGLANG_PIC_SPARSE_TOPK": args.topk,
                  "SGLANG_PIC_SPARSE_CANDIDATES": args.candidates,
                  "SGLANG_PIC_SPARSE_MAX_REQUESTS": args.max_requests,
                  "SGLANG_PIC_SPARSE_MAX_CONTEXT": context}
    params = {"cases": cases, "seed": 0, "vocab": 128000, "repeats": args.repeats,
              "sparse_env": sparse_env, "profile_steps": args.profile_steps,
              "profile_cpu": args.profile_cpu,
              # a temporary folder only when traces are written: the parameters of two calls
              # must compare equal for --resume-from and --combine
              "profile_dir": args.profile_dir or (
                  tempfile.mkdtemp(prefix="sparse_profile_") if args.profile_steps else None)}
    report = run_side_by_side(
        "sparse_e2e_decode", "sparse.bench_e2e_decode", "workload", engine_kwargs, params,
        higher_is_better={f"tokens_per_s_{c}" for c in cases},
        variants=variants, timeout_s=590, out_dir=args.out,
        rounds=args.rounds, resume_from=args.resume_from,
        variant_kwargs=variant_kwargs)
    out_dir = Path(args.out) if args.out else RESULTS
    report = _merge_earlier(report, out_dir / "sparse_e2e_decode.json.prev")
    print_speedups(report)
    plot(report, out_dir)


def print_speedups(report: dict) -> None:
    """Every sparse variant against vanilla, per case (the ratio table pairs vanilla with one),
    and the share of output ids equal to vanilla's."""
    res, cases = report["results"], report["params"]["cases"]
    print(f"\n{'variant':>22} {'case':>12} {'vanilla TPOT':>13} {'sparse TPOT':>12} "
          f"{'speed-up':>9} {'same ids':>9}")
    for variant in (v for v in res if v in SPARSE_VARIANTS or reselect_variant(v)):
        for c in cases:
            v = res.get("vanilla", {}).get(f"tpot_ms_{c}")
            s = res[variant].get(f"tpot_ms_{c}")
            iv = res.get("vanilla", {}).get(f"output_ids_{c}")
            is_ = res[variant].get(f"output_ids_{c}")
            same = (sum(a == b for a, b in zip(iv, is_, strict=False)) / len(iv)
                    if iv and is_ else float("nan"))
            speed = f"{v / s:.2f}x" if v and s else "-"
            print(f"{variant:>22} {c:>12} {v or float('nan'):>12.2f}  "
                  f"{s or float('nan'):>11.2f} {speed:>9} {same:>9.2f}")


if __name__ == "__main__":
    main()
