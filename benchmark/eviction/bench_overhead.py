"""Policy overhead at scale: one ``RadixCache.evict`` call over N evictable leaves, per policy.

SGLang's ``evict`` scores every evictable leaf (``get_priority``) and heapifies them on each
call, so a policy's per-leaf cost times the number of leaves is what it adds to a scheduler step
that has to evict. Builds a cache of N leaves (sessions under shared system prompts, as in chat
serving), then times evict calls and inserts.

    python -m benchmark.eviction.bench_overhead [--leaves 10000 20000]
"""

from __future__ import annotations

import argparse
import json
import time
from array import array
from pathlib import Path

from benchmark import description

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def build(policy: str, leaves: int):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using
    from sglang_pic.eviction.replay.simulator import make_cache

    cache, _ = make_cache(policy)
    strategy = cache.eviction_strategy
    t_insert = 0.0
    for i in range(leaves):
        system = [1 + i % 8] * 64
        tokens = system + [10_000 + i] * 16
        ctx = RequestContext(session_id=f"s{i % (leaves // 4)}", app_type="chat",
                             segments=[(0, "system"), (64, "user")], decode_start=80,
                             prompt_len=80, now=float(i))
        if hasattr(strategy, "now_fn"):
            strategy.now_fn = lambda t=float(i): t
        t0 = time.perf_counter()
        with using(ctx):
            cache.insert(InsertParams(key=RadixKey(array("q", tokens), None), value=None))
        t_insert += time.perf_counter() - t0
    return cache, t_insert / leaves


def main() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_pic.plugin import register_feature

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--leaves", type=int, nargs="+", default=[10000, 20000])
    ap.add_argument("--out", default=str(REPO / "benchmark" / "results" / "eviction_overhead.json"))
    args = ap.parse_args()
    register_feature("eviction")
    HookRegistry.apply_hooks()
    rows = []
    for n in args.leaves:
        for policy in ("lru", "slru", "gdsf", "s3fifo", "sae"):
            cache, insert_s = build(policy, n)
            evictable = len(cache.evictable_leaves)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                cache.evict(EvictParams(num_tokens=16))
                times.append(time.perf_counter() - t0)
            times.sort()
            row = {"leaves": evictable, "policy": policy, "evict_ms": 1000 * times[len(times) // 2],
                   "per_leaf_us": 1e6 * times[len(times) // 2] / max(evictable, 1),
                   "insert_us": 1e6 * insert_s}
            rows.append(row)
            print(f"{n:>6} leaves  {policy:<7} evict {row['evict_ms']:7.2f} ms  "
                  f"({row['per_leaf_us']:.2f} us/leaf)  insert {row['insert_us']:6.1f} us",
                  flush=True)
    Path(args.out).write_text(json.dumps({"benchmark": "eviction_overhead", "rows": rows},
                                         indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
