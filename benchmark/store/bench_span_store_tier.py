"""What the span store tier costs the scheduler thread: saving a span unit to PTStore and loading
it back, in blocks of about 4 MiB against one store entry per pool page.

The span tier (``sglang_pic/spans/store_tier.py``) runs inside SGLang's scheduler: ``save`` when
a span unit's prefill is cached, ``load`` before a unit would be prefilled. Every millisecond it
holds the scheduler thread is a millisecond no batch is scheduled. With SGLang's page size of 1,
one store entry per pool page is one entry, key, checksum and message frame per token.

Per model shape (Llama-3-8B: 128 KiB of KV per token; SmolLM2-135M: 22.5 KiB) and span length
(128, 900 and 4096 tokens: the RAG grid's log-normal documents, from short to long), each variant
saves a unit from a KV pool, waits until the store holds it, then loads it into an emptied tree
(checked bit for bit against what was saved). Reported per cell:

* ``save_ms`` / ``load_ms``: time on the calling (scheduler) thread (with ``--device cuda`` the
  device copies run on the stream after the call returns, as the next forward's would);
* ``stored_ms``: from the save until the store holds every block (the writer thread);
* ``busy_share``: how much a pure-Python loop on the scheduler thread gets done while the writer
  sends, against the same loop alone (1.0: the writer never takes the GIL from it);
* ``stolen_ms``: the scheduler time the writer took, ``(1 - busy_share)`` of its sending time.

Variants alternate in ``--rounds``; one store server runs in its own process.

    python3 -m benchmark.store.bench_span_store_tier [--out DIR] [--rounds 3] [--device cpu|cuda]
    python3 -m benchmark.store.bench_span_store_tier --smoke      # ~30 s, a temp folder

Prints a table and writes ``span_store_tier.json`` (machine, versions, config, every sample) and
a plot (``docs/figures/span_store_tier.png`` unless ``--smoke``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmark import description
from benchmark.harness import _write_report, environment, save_figure, start_store_servers

HERE = Path(__file__).resolve().parent

REPO = HERE.parent.parent
TOKEN = "bench-span-store-tier-token"
SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (30, 3, 64)}
"""Model shape -> (layers, KV heads, head dim) of a bfloat16 KV pool."""
LENGTHS = (128, 900, 4096)
VARIANTS = ("token pages", "4 MiB blocks")
"""``token pages``: a block per pool page (page size 1), as the tier stored spans before
blocks; ``4 MiB blocks``: the tier's default."""


def make_tier(shape: tuple[int, int, int], variant: str, endpoints: list[str], device: str,
              pool_tokens: int):
    """A span store tier over an empty KV pool of ``shape`` in a radix tree."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang_pic.spans.store_tier import SpanStoreTier
    from sglang_pic.store.client import StoreClient

    layers, heads, dim = shape
    pool = MHATokenToKVPool(pool_tokens, 1, torch.bfloat16, heads, dim, layers, device, False)
    alloc = TokenToKVPoolAllocator(pool_tokens, torch.bfloat16, device, pool, False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                       token_to_kv_pool_allocator=alloc, page_size=1))
    # the loop measuring the writer's share of the GIL also slows it: on a 2-core machine a
    # 512 MiB unit may take longer than the client's default allowance (0.5 GB/s)
    client = StoreClient(endpoints, token=TOKEN, shm=False, min_gbps=0.02)
    return SpanStoreTier(cache, client, f"bench-{variant}",
                         block_tokens=1 if variant == "token pages" else None)


def busy(seconds: float) -> int:
    """Iterations of a pure-Python loop in ``seconds`` (a scheduler's share of the GIL)."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(1000):
            pass
        n += 1
    return n


def copied(tier, rows):
    """The pool rows ``rows`` on the host, once copied (a GPU gather is asynchronous)."""
    host, event = tier.rows.gather(rows)
    if event is not None:
        event.synchronize()
    return host


def one_sample(tier, length: int, tag: str, idle_rate: float) -> dict:
    """Save a ``length``-token unit, wait for the store, load it back into an emptied tree."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.spans.store_tier import block_keys

    cache, pool = tier.cache, tier.rows
    alloc = cache.token_to_kv_pool_allocator
    cache.reset()
    alloc.clear()
    ids = [hash((tag, i)) & ((1 << 62) - 1) for i in range(length)]
    rows = alloc.alloc(length)
    for layer in range(len(pool.k)):
        pool.k[layer][rows] = torch.randn(pool.k[layer][rows].shape).to(pool.k[layer])
        pool.v[layer][rows] = torch.randn(pool.v[layer][rows].shape).to(pool.v[layer])
    cache.insert(InsertParams(key=RadixKey(ids, None), value=rows))
    saved = copied(tier, rows)
    keys = block_keys(ids, None, tier.block_tokens, tier.tag)

    t0 = time.perf_counter()
    tier.save(ids, None, 0, length)
    save_ms = (time.perf_counter() - t0) * 1e3
    loops, t1 = 0, time.perf_counter()
    while tier.pending_bytes() and time.perf_counter() - t0 < 120:
        loops += busy(0.01)
    stored_ms = (time.perf_counter() - t0) * 1e3
    busy_share = loops / max(1e-9, (time.perf_counter() - t1) * idle_rate)
    if not all(tier.client.batch_exists(keys)):
        raise RuntimeError(f"{tag}: the store does not hold every block after 120 s")

    cache.reset()
    alloc.clear()
    t0 = time.perf_counter()
    ok = tier.load(ids, None, 0, length, first_position=0)
    load_ms = (time.perf_counter() - t0) * 1e3
    got = cache.match_prefix(MatchPrefixParams(key=RadixKey(ids, None))).device_indices
    if not ok or len(got) != length or not torch.equal(copied(tier, got), saved):
        raise RuntimeError(f"{tag}: the loaded span differs from the saved one")
    return {"save_ms": save_ms, "stored_ms": stored_ms, "load_ms": load_ms,
            "busy_share": busy_share, "stolen_ms": (1 - busy_share) * (stored_ms - save_ms),
            "blocks": len(keys)}


def cell_summary(samples: list[dict]) -> dict:
    out = {}
    for k in ("save_ms", "stored_ms", "load_ms", "busy_share", "stolen_ms"):
        xs = [s[k] for s in samples]
        out[k] = statistics.median(xs)
        out[f"{k}_all"] = xs
    out["blocks"] = samples[0]["blocks"]
    return out


def plot(report: dict, out: Path) -> Path:
    """Scheduler-thread load and save time per span length, one panel per model shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(report["cells"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.2 * len(shapes), 3.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for variant in VARIANTS:
            cells = report["cells"][shape][variant]
            lengths = sorted(cells, key=int)
            for metric, style in (("load_ms", "-o"), ("save_ms", "--s")):
                ax.plot([int(n) for n in lengths], [cells[n][metric] for n in lengths], style,
                        label=f"{variant}, {metric[:4]}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.minorticks_off()
        ax.set_xticks([int(n) for n in lengths], [str(n) for n in lengths])
        ax.set_xlabel("span length (tokens)")
        ax.set_ylabel("scheduler thread (ms)")
        ax.set_title(f"{shape} KV, {report['config']['device']}", fontsize=9)
        ax.legend(fontsize=7)
    return save_figure(fig, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--rounds", type=int, default=3, help="samples per cell, variants alternating")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="SmolLM2's shape, 1 round, a temp folder")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    if not shapes or set(shapes) - set(SHAPES):
        ap.error(f"--shapes: choose from {', '.join(SHAPES)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    lengths = LENGTHS
    if args.smoke:
        shapes, lengths, args.rounds = ["smollm2-135m"], (128, 900), 1
        args.out = args.out or tempfile.mkdtemp(prefix="sglang-pic-bench-")
    procs, endpoints = start_store_servers(1, TOKEN, memory_gb=8.0)
    idle_rate = busy(1.0) / 1.0
    cells: dict = {}
    try:
        for shape in shapes:
            tiers = {v: make_tier(SHAPES[shape], v, endpoints, args.device, 2 * max(lengths))
                     for v in VARIANTS}
            samples: dict = {v: {n: [] for n in lengths} for v in VARIANTS}
            for r in range(args.rounds):
                for n in lengths:
                    for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                        s = one_sample(tiers[v], n, f"{shape}-{v}-{n}-{r}", idle_rate)
                        samples[v][n].append(s)
                        print(f"[bench] {shape}, {n} tokens, {v}, round {r + 1}/{args.rounds}: "
                              f"save {s['save_ms']:.1f} ms, load {s['load_ms']:.1f} ms, stored "
                              f"after {s['stored_ms']:.0f} ms, {s['stolen_ms']:.0f} ms of it "
                              "taken from the scheduler",
                              flush=True)
            cells[shape] = {v: {str(n): cell_summary(samples[v][n]) for n in lengths}
                            for v in VARIANTS}
            for tier in tiers.values():  # its writer thread holds the tier and its KV pool
                tier.close()
            del tiers
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    report = {"benchmark": "span_store_tier", "environment": environment(),
              "config": {"device": args.device, "rounds": args.rounds, "lengths": list(lengths),
                         "shapes": {s: SHAPES[s] for s in shapes}, "store_servers": 1,
                         "smoke": args.smoke},
              "cells": cells}
    print(f"{'shape':<14}{'tokens':>7}  {'variant':<14}{'save ms':>9}{'load ms':>9}"
          f"{'stored ms':>11}{'stolen ms':>11}{'blocks':>7}")
    for shape, by_variant in cells.items():
        for v, by_len in by_variant.items():
            for n, c in by_len.items():
                print(f"{shape:<14}{n:>7}  {v:<14}{c['save_ms']:>9.1f}{c['load_ms']:>9.1f}"
                      f"{c['stored_ms']:>11.0f}{c['stolen_ms']:>11.0f}{c['blocks']:>7}")
    path = _write_report("span_store_tier", args.out, report)
    print(f"[bench] wrote {path}")
    plot(report, (path.parent if args.smoke else REPO / "docs" / "figures") / "span_store_tier.png")


if __name__ == "__main__":
    main()
