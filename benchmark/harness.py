"""Side-by-side benchmark harness: vanilla SGLang 0.5.17 vs sglang-pic, in one run.

Each *variant* runs the same workload in its own process, so the two never share an Engine,
CUDA context or imported plugin:

- ``vanilla``: SGLang as installed (on the H200: the devkit); SGLang finds no
  ``sglang.srt.plugins`` entry point from us, so none of our hooks is registered (our source
  tree may be importable: the benchmark modules' own helpers import it). It runs on
  **FlashInfer**, the fastest attention backend SGLang 0.5.17 has on the device (SGLang's Hopper
  default, FA3, is not in the devkit: docs/benchmarks.md says why). Every headline ratio is
  against this variant.
- ``vanilla-triton``: the same, on SGLang's triton backend: a second column, never a headline.
- ``sglang-pic``: the same SGLang, plus a minimal ``sglang_pic-*.dist-info`` that declares our
  entry point, so SGLang loads our plugin in every process exactly as a ``pip install`` would
  (the device has no network and no build tools).

The benchmarks are modules of the ``benchmark`` package, run from the repository root as
``python -m benchmark.<module>`` (``python/`` and ``sgl-kernel/python/`` importable: installed in
the virtual environment, on ``PYTHONPATH`` on the device).

A workload is a function ``fn(engine_kwargs: dict, params: dict) -> dict`` in a benchmark module
(named relative to the package: ``bench_spans``, ``eviction.bench_e2e``);
the harness calls it in the child with the variant's engine arguments and collects the returned
numbers. ``run_side_by_side`` prints a table and writes JSON (machine, versions, config, raw
numbers and pic/vanilla ratios) into ``benchmark/results/``.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmark" / "results"
MODELS = REPO / "benchmark" / "models"
VARIANTS = ("vanilla", "sglang-pic")
ROUND_ENV = "SGLANG_PIC_BENCH_ROUND"
"""The round a variant's process runs (0-based): a workload that draws fresh prompts per process
seeds with it, so that a later round's "new" prompts are not the ones an earlier round stored."""
# The attention backend of each vanilla variant (``vanilla`` is the baseline of every headline).
VANILLA_BACKENDS = {"vanilla": "flashinfer", "vanilla-triton": "triton"}
# Llama-3.1-8B shape with dummy weights, token ids only, vanilla SGLang's FlashInfer backend: the
# common base of the H200 benchmarks (each adds its context length, memory fraction and graph
# sizes; a sglang-pic variant names its own backend where its feature needs one).
LLAMA3_8B_DUMMY = {
    "model_path": "benchmark/models/llama3-8b",
    "load_format": "dummy",
    "skip_tokenizer_init": True,
    "attention_backend": "flashinfer",
    "dtype": "bfloat16",
    "disable_prefill_cuda_graph": True,
}


def plugin_site(root: Path) -> Path:
    """A folder that makes our source tree an installed distribution for importlib.metadata
    (``sglang_pic.launcher.plugin_site.write_site``)."""
    from sglang_pic.launcher.plugin_site import write_site

    return write_site(root)


RESELECT_VARIANT = re.compile(r"(sglang-pic.*)-([rv])([1-9][0-9]*)")
INTERVAL_KNOBS = {"r": "reselect_interval", "v": "vote_interval"}
"""A variant's suffix letter: ``-r<N>`` runs ``--sparse-reselect-interval N``, ``-v<N>``
``--sparse-vote-interval N``."""


def reselect_variant(variant: str) -> tuple[str, int, str] | None:
    """``<sparse variant>-r<N>`` (``sglang-pic-flashinfer-r4``) or ``-v<N>``: ``(the sparse
    variant, N, the knob)`` with the knob ``reselect_interval`` or ``vote_interval``
    (``variant_env`` sets its variable); None for any other name."""
    m = RESELECT_VARIANT.fullmatch(variant)
    return (m[1], int(m[3]), INTERVAL_KNOBS[m[2]]) if m else None


def sparse_variant_kwargs(variants: tuple[str, ...], sparse: dict[str, dict],
                          others: tuple[str, ...] = ("vanilla",)) -> dict[str, dict]:
    """Each of ``variants``' engine kwargs: those ``sparse`` gives, and for ``<one of them>-r<N>``
    or ``-v<N>`` its base's (``variant_env`` sets the interval). ``others`` are known variants
    with none of their own. Raises ValueError naming the known variants for any other name,
    and for an interval over the server's bound."""
    from sglang_pic.sparse.config import MAX_RESELECT_INTERVAL, SparseDecodeConfig

    out = {}
    for v in variants:
        reselect = reselect_variant(v)
        if v in sparse:
            out[v] = sparse[v]
        elif reselect and reselect[0] in sparse:
            if reselect[1] > MAX_RESELECT_INTERVAL:
                raise ValueError(f"{v}: {SparseDecodeConfig.flag(reselect[2])} must be <= "
                                 f"{MAX_RESELECT_INTERVAL}, got {reselect[1]}")
            out[v] = sparse[reselect[0]]
        elif v not in others:
            raise ValueError(f"unknown variant {v!r}: known {', '.join((*others, *sparse))}, "
                             "and a sparse one with -r<N> (--sparse-reselect-interval N) or "
                             "-v<N> (--sparse-vote-interval N)")
    return out


def variant_env(variant: str, site: Path, gpus: str | None = None) -> dict[str, str]:
    """The environment of a variant's process: our source tree on the path (its modules, for
    the workloads' helpers), our plugin's entry point for sglang-pic variants only, the
    variant's name, ``gpus`` (``CUDA_VISIBLE_DEVICES``) when given, and a
    ``-r<N>`` or ``-v<N>`` variant's interval (``reselect_variant``)."""
    env = dict(os.environ)
    reselect = reselect_variant(variant)
    if reselect:
        env[f"SGLANG_PIC_SPARSE_{reselect[2].upper()}"] = str(reselect[1])
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    ours = {str(REPO / "python"), str(REPO / "sgl-kernel" / "python"), str(site)}
    parts = [p for p in parts if p not in ours]
    parts = [str(REPO / "python"), str(REPO / "sgl-kernel" / "python"), *parts]
    if variant.startswith("sglang-pic"):  # "sglang-pic" and its configurations ("sglang-pic-x")
        parts = [str(site), *parts]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env[VARIANT_ENV] = variant
    return env


def environment() -> dict[str, Any]:
    """Machine and versions, recorded with every result."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    for mod in ("sglang", "triton"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except ImportError:
            info[mod] = None
    return info


def _child(spec_path: str) -> None:
    """Runs inside the variant's process: `python -m benchmark.harness --child SPEC.json`."""
    t0 = time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    fn = getattr(importlib.import_module(f"benchmark.{spec['module']}"), spec["func"])
    t1 = time.perf_counter()
    result = fn(spec["engine_kwargs"], spec["params"])
    # where a variant's wall time went beyond its engine (a fresh machine's first process
    # compiles and loads more than the next ones)
    result["child_import_s"] = round(t1 - t0, 2)
    result["child_workload_s"] = round(time.perf_counter() - t1, 2)
    print(f"[bench] variant process: imports {t1 - t0:.1f} s, workload "
          f"{result['child_workload_s']:.1f} s", flush=True)
    try:
        import sglang_pic.plugin as plugin

        result["plugin_loaded"] = bool(plugin._registered)
    except ImportError:
        result["plugin_loaded"] = False
    Path(spec["out"]).write_text(json.dumps(result))


def ratio_table(results: dict[str, dict], higher_is_better: set[str]) -> list[dict]:
    """Rows of (metric, vanilla, pic, ratio pic/vanilla) for every numeric metric both reported."""
    rows = []
    van = results.get("vanilla", {})
    pic = next((r for v, r in results.items() if v.startswith("sglang-pic")), {})
    for key, v in van.items():
        p = pic.get(key)
        if isinstance(v, (int, float)) and isinstance(p, (int, float)) and not isinstance(v, bool):
            rows.append(
                {
                    "metric": key,
                    "vanilla": v,
                    "sglang-pic": p,
                    "ratio": (p / v) if v else None,
                    "better": "higher" if key in higher_is_better else "lower",
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'metric':<40}{'vanilla':>14}{'sglang-pic':>14}{'pic/vanilla':>13}")
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        print(f"{r['metric']:<40}{r['vanilla']:>14.4g}{r['sglang-pic']:>14.4g}{ratio:>13}")


def merge_rounds(runs: list[dict]) -> dict:
    """One variant's results from several rounds (each a fresh process): every sample list
    ``<metric>_all`` concatenated and ``<metric>`` its median; each metric's per-round medians in
    ``<metric>_rounds``; anything else from the first round. A failed round fails the variant."""
    failed = [r for r in runs if "error" in r]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    merged = dict(runs[0])
    # every round's sample lists, also one the first round did not record (a resumed run whose
    # earlier rounds predate a new list keeps the new rounds' samples)
    for key in dict.fromkeys(k for r in runs for k in r):
        if key.endswith("_all") and all(isinstance(r.get(key, []), list) for r in runs):
            metric = key.removesuffix("_all")
            samples = [x for r in runs for x in r.get(key, [])]
            merged[key] = samples
            if not all(isinstance(x, (int, float)) for x in samples):
                continue  # e.g. per-sample phase splits: pooled, no median of their own
            merged[metric] = statistics.median(samples)
            merged[f"{metric}_rounds"] = [  # a run may itself be pooled rounds (resume_from)
                x for r in runs for x in (r.get(f"{metric}_rounds") or [r.get(metric)])
                if x is not None]
    merged["rounds"] = sum(int(r.get("rounds", 1)) for r in runs)
    return merged


def run_side_by_side(
    name: str,
    module: str,
    func: str,
    engine_kwargs: dict,
    params: dict,
    higher_is_better: set[str] = frozenset(),
    variants: tuple[str, ...] = VARIANTS,
    timeout_s: float = 1200,
    out_dir: str | None = None,
    variant_kwargs: dict[str, dict] | None = None,
    rounds: int = 1,
    variant_gpus: dict[str, str] | None = None,
    resume_from: str | None = None,
    variant_settings: dict[str, dict[str, str]] | None = None,
) -> dict:
    """Run `module.func` once per variant and round, each in a fresh process; write and return
    the report.

    ``resume_from``: the report of earlier rounds of the same benchmark, engine arguments and
    parameters (a device call holds only so many rounds): this call's rounds continue its
    alternation and its samples are pooled with theirs (``calls`` counts the calls).

    ``variant_kwargs`` overrides engine arguments per variant (e.g. the attention backend a
    sglang-pic feature needs); everything else is the same for both. With ``rounds`` > 1 the
    order alternates (A B, then B A, ...) so that neither side always runs first, and each
    variant's samples are pooled over its rounds (``merge_rounds``). ``variant_gpus`` pins a
    variant's process to GPUs (``CUDA_VISIBLE_DEVICES``), e.g. the instance that computes on one
    GPU and the one that loads on another. ``variant_settings`` adds variables to a variant's
    process: the hand-offs of our serve flags the scheduler reads (e.g. ``--position-free-span-
    graphs`` as ``SGLANG_PIC_SPAN_GRAPHS``), which an ``Engine`` takes no argument for.
    """
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    results: dict[str, dict] = {}
    first, calls = 0, 1
    if resume_from is not None:
        earlier = json.loads(Path(resume_from).read_text())
        for key, mine in (("benchmark", name), ("engine_kwargs", engine_kwargs),
                          ("params", params), ("variant_kwargs", variant_kwargs or {})):
            if json.loads(json.dumps(mine)) != earlier.get(key):
                raise SystemExit(f"--resume-from {resume_from}: its {key} differs from this "
                                 "run's; only rounds of the same benchmark and settings pool")
        if earlier.get("failed_variants") or sorted(earlier["results"]) != sorted(variants):
            raise SystemExit(f"--resume-from {resume_from}: not a complete run of variants "
                             f"{', '.join(variants)}")
        first, calls = int(earlier.get("rounds", 1)), int(earlier.get("calls", 1)) + 1
        runs = {v: [earlier["results"][v]] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        site = plugin_site(Path(tmp) / "site")
        for round_no in range(first, first + rounds):
            order = variants if round_no % 2 == 0 else tuple(reversed(variants))
            for variant in order:
                out = Path(tmp) / f"{variant}.{round_no}.json"
                spec = Path(tmp) / f"{variant}.{round_no}.spec.json"
                kwargs = {**engine_kwargs, **(variant_kwargs or {}).get(variant, {})}
                if variant in VANILLA_BACKENDS and "device" not in kwargs:  # GPU runs only
                    kwargs["attention_backend"] = VANILLA_BACKENDS[variant]
                spec.write_text(json.dumps({"module": module, "func": func, "out": str(out),
                                            "engine_kwargs": kwargs, "params": params}))
                tag = f" (round {round_no + 1}/{first + rounds})" if first + rounds > 1 else ""
                print(f"[bench] {name}: running {variant}{tag} ...", flush=True)
                t0 = time.perf_counter()
                env = variant_env(variant, site, (variant_gpus or {}).get(variant))
                env[ROUND_ENV] = str(round_no)
                env.update((variant_settings or {}).get(variant, {}))
                proc = subprocess.run(
                    [sys.executable, "-m", "benchmark.harness", "--child", str(spec)], env=env,
                    cwd=REPO, timeout=timeout_s,
                )
                if proc.returncode != 0 or not out.exists():
                    result = {"error": f"exit code {proc.returncode}"}
                else:
                    result = json.loads(out.read_text())
                    # the workload may pick the backend its feature needs: it reports it then
                    result.setdefault("attention_backend", kwargs.get("attention_backend"))
                runs[variant].append(result)
                results[variant] = merge_rounds(runs[variant])
                print(f"[bench] {variant} done in {time.perf_counter() - t0:.0f} s", flush=True)
                done = sum(len(r) for r in runs.values()) - (len(variants) if first else 0)
                if done < rounds * len(variants):  # a partial report survives a later crash
                    _write_report(name, out_dir, {"benchmark": name, "partial": True,
                                                  "environment": environment(), "params": params,
                                                  "results": results})
    rows = ratio_table(results, set(higher_is_better))
    report = {
        "benchmark": name,
        "environment": environment(),
        "engine_kwargs": engine_kwargs,
        "variant_kwargs": variant_kwargs or {},
        "variant_settings": variant_settings or {},
        "params": params,
        "rounds": first + rounds,
        "calls": calls,
        "variant_gpus": variant_gpus or {},
        "results": results,
        "ratios": rows,
    }
    print_table(rows)
    failed = sorted(v for v, r in results.items() if "error" in r)
    if failed:  # nothing that looks like a result: the caller exits non-zero
        report["failed_variants"] = failed
        path = _write_report(f"{name}.failed", out_dir, report)
        raise BenchmarkFailed(f"variant(s) {', '.join(failed)} failed; report in {path}")
    path = _write_report(name, out_dir, report)
    print(f"[bench] wrote {path}")
    return report


def run_settings(report: dict, volatile: tuple[str, ...] = ("profile_dir",)) -> tuple:
    """What two reports must share for their samples to pool: the benchmark, the engine
    arguments and the parameters, ``volatile`` ones (a per-call temporary folder) aside."""
    params = {k: v for k, v in report.get("params", {}).items() if k not in volatile}
    return (report.get("benchmark"), report.get("engine_kwargs"), params)


def combine_reports(paths: list[Path], volatile: tuple[str, ...] = ("profile_dir",)) -> dict:
    """One report from complete reports of the same benchmark, engine arguments and parameters
    (``volatile`` parameters aside), each a device call that ran some of the variants: a
    variant in several reports has its samples pooled (``merge_rounds``); ``calls`` counts the
    reports and ``combined_from`` keeps each one's variants, in the order they ran, and its
    machine. Raises ValueError naming the first report that differs or failed."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    for path, r in zip(paths, reports, strict=True):
        if r.get("failed_variants") or r.get("partial"):
            raise ValueError(f"{path}: a failed or partial run is not combined")
        if run_settings(r, volatile) != run_settings(reports[0], volatile):
            raise ValueError(f"{path}: other benchmark, engine arguments or parameters than "
                             f"{paths[0]}")
    runs: dict[str, list[dict]] = {}
    for r in reports:
        for variant, result in r["results"].items():
            runs.setdefault(variant, []).append(result)
    results = {v: merge_rounds(rs) for v, rs in runs.items()}
    higher = {row["metric"] for r in reports for row in r.get("ratios", [])
              if row.get("better") == "higher"}
    first = reports[0]
    return {
        "benchmark": first["benchmark"], "environment": first["environment"],
        "engine_kwargs": first["engine_kwargs"],
        "variant_kwargs": {k: v for r in reports for k, v in r.get("variant_kwargs", {}).items()},
        "params": first["params"], "rounds": max(len(rs) for rs in runs.values()),
        "calls": len(reports),
        "combined_from": [{"file": Path(p).name, "variants": list(r["results"]),
                           "environment": r.get("environment")}
                          for p, r in zip(paths, reports, strict=True)],
        "results": results, "ratios": ratio_table(results, higher),
    }


class BenchmarkFailed(SystemExit):
    """A variant of a side-by-side run failed: the run writes ``<name>.failed.json`` (for the
    post-mortem) instead of a result and the benchmark exits non-zero."""


async def stream_generate(engine, ids: list[int], sp: dict,
                          start: float | None = None) -> tuple[float, float, dict]:
    """Stream one request through ``Engine.async_generate``; returns (time to the first chunk,
    time to the last, the last chunk), both from ``start`` (default: when the request is sent)."""
    t0 = time.perf_counter() if start is None else start
    first = None
    last: dict = {}
    gen = await engine.async_generate(input_ids=ids, sampling_params=sp, stream=True)
    async for chunk in gen:
        if first is None:
            first = time.perf_counter() - t0
        last = chunk
    return first or 0.0, time.perf_counter() - t0, last


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_store_servers(n: int, token: str | None, memory_gb: float, env: dict | None = None,
                        log_dir: Path | None = None,
                        timeout_s: float = 60) -> tuple[list[subprocess.Popen], list[str]]:
    """``n`` PTStore servers (``sglang-pic store``) on loopback ports, each its own process,
    returned once every one answers ``status``; their output goes to ``log_dir/store<i>.log``
    when given. ``token`` reaches them in ``$SGLANG_PIC_STORE_TOKEN`` (None: ``--insecure``)."""
    from sglang_pic.store.client import StoreClient

    if env is None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    env = {k: v for k, v in env.items() if k != "SGLANG_PIC_STORE_TOKEN"}
    auth = ["--insecure"]
    if token is not None:
        env["SGLANG_PIC_STORE_TOKEN"], auth = token, []
    procs, endpoints = [], []
    for i in range(n):
        ep = f"tcp://127.0.0.1:{free_port()}"
        out = open(log_dir / f"store{i}.log", "w") if log_dir else None
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sglang_pic", "store", "--endpoint", ep, "--memory-gb",
             str(memory_gb), *auth], env=env, stdout=out,
            stderr=subprocess.STDOUT if out else None, start_new_session=log_dir is not None))
        endpoints.append(ep)
    client = StoreClient(endpoints, token, timeout_ms=500)
    try:
        deadline = time.time() + timeout_s
        pending = list(endpoints)
        while pending:
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"store servers not up: {pending}")
            pending = [ep for ep in pending if client.status(ep) is None]
    finally:
        client.close()
    return procs, endpoints


def store_totals(endpoints: list[str], token: str,
                 keys: tuple[str, ...] = ("bytes_in", "bytes_out", "hits", "misses")) -> dict:
    """``keys`` of the store servers' ``status``, summed over ``endpoints`` (a server that does
    not answer counts 0)."""
    from sglang_pic.store.client import StoreClient

    client = StoreClient(endpoints, token, timeout_ms=2000)
    try:
        status = [client.status(ep) or {} for ep in endpoints]
    finally:
        client.close()
    return {k: sum(int(s.get(k, 0)) for s in status) for k in keys}


def save_figure(fig, out: Path) -> Path:
    """Lay out, write (creating the folder) and announce a matplotlib figure."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return out


def cpu_smoke_engine(**overrides) -> dict:
    """Engine arguments of a ``--smoke`` run: SGLang's CPU engine (selected here, before SGLang
    is imported) on the embedded SmolLM2, no radix cache, no CUDA graphs; ``overrides`` win."""
    from sglang_pic.cpu.support import enable_cpu_engine
    from sglang_pic.launcher.default_model import ensure_default_model

    enable_cpu_engine()
    return {"model_path": str(ensure_default_model()), "device": "cpu",
            "skip_tokenizer_init": True, "attention_backend": "torch_native",
            "disable_radix_cache": True, "disable_cuda_graph": True, "log_level": "info",
            **overrides}


def gpu_tag(device=None) -> str:
    """A result file's machine suffix: the GPU's model (``h200`` of "NVIDIA H200", ``h100`` of
    "NVIDIA H100 80GB HBM3"; else the name's last word), or ``cpu`` when ``device`` (a
    ``torch.device``; default: the first GPU if any) is not a GPU."""
    import re

    import torch

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type != "cuda":
        return "cpu"
    words = torch.cuda.get_device_name(device).split()
    model = next((w for w in words if re.fullmatch(r"[A-Z]+\d{2,}[A-Za-z]*", w)), words[-1])
    return model.lower()


VARIANT_ENV = "SGLANG_PIC_BENCH_VARIANT"
"""The variant a child process runs (``variant_env`` sets it)."""


def current_variant() -> str:
    """The variant this child process runs."""
    return os.environ.get(VARIANT_ENV, "vanilla")


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (nearest rank, no interpolation)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def engine_arguments(engine_kwargs: dict, span_backend: str | None = None) -> dict:
    """A variant's engine arguments in its process: a model path relative to the repository made
    absolute; with ``span_backend`` (a span variant), that position-free attention backend and
    the span radix cache."""
    kwargs = dict(engine_kwargs)
    path = Path(kwargs["model_path"])
    if not path.is_absolute() and (REPO / path).exists():
        kwargs["model_path"] = str(REPO / path)
    if span_backend is not None:
        kwargs["attention_backend"] = span_backend
        kwargs["radix_cache_backend"] = "pic_span"
    return kwargs


def smoke_dir() -> str:
    """Where ``--smoke`` / ``--quick`` runs write (never the tracked ``benchmark/results``)."""
    folder = Path(tempfile.gettempdir()) / "sglang-pic-bench"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


def _write_report(name: str, out_dir: str | None, report: dict) -> Path:
    folder = Path(out_dir) if out_dir else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(report, indent=2))
    return path


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        sys.exit("usage: harness.py --child SPEC.json (internal; run a benchmark script instead)")
