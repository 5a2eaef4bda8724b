"""Replay a trace through SGLang's own ``HiRadixCache``: a device tier and a HiCache host tier.

``simulator.replay`` drives one ``RadixCache``; a deployment with HiCache has two tiers with
their own rules: write-through copies every block to the host tier (unless the policy defers it,
``sae.worth_host_copy``), the device tier demotes a block that has a host copy and deletes one
that has none, the host tier evicts when a write finds it full (in the policy's order), and a
prefix found on the host tier is loaded back before the request runs. This replays a trace
through SGLang 0.5.17's ``HiRadixCache`` itself, with a stand-in for its cache controller that
counts tokens instead of moving them (``_TokenCountingController``), so every one of those
decisions is SGLang's and the policy's, as in a server with ``--enable-hierarchical-cache``.

Per request, as the scheduler does: match (device part, host part), load the host part back
(``init_load_back``: room is made on the device tier by its own eviction), cache the prompt and
output (device eviction first if the tier is full), then acknowledge the write-through copies
at once (on the H200 they take milliseconds; a request arriving within them would find its
blocks not yet on the host, which this does not model). A hit is a token the request did not
recompute: found on the device, or loaded back from the host (``host_hit_tokens``, the part
that cost a PCIe copy instead).

    .venv/bin/python -m benchmark.eviction.two_tier [--device-tokens 500000]
        [--host-tokens 4000000] [--policies lru,fifo,...,sae] [--limit N] [--workers 2]
    .venv/bin/python -m benchmark.eviction.two_tier --workloads mix,chat,agent,single \
        --fractions 0.05,0.2 --policies fifo,lru,sae,sae-copy-all

The first replays the Mooncake conversation trace at the deployment sizes and writes
``benchmark/results/eviction_replay_mooncake_two_tier.json``; the second replays generated
workloads (``traces.generate``, ``--scale``, ``--seeds``; with token types and application
types, so ``sae`` has chain-of-thought and single-turn blocks whose host copies it defers) with
the tiers sized as fractions of each trace's unique tokens (device, host), and writes
``eviction_two_tier_generated.json``: ``sae`` against ``sae-copy-all`` is what deferring is
worth. One row per workload, seed and policy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

from sglang_pic.eviction.policy import configure
from sglang_pic.eviction.replay.simulator import (
    CountingAllocator,
    _Clock,
    _node_hash,
    _patched,
    _slots,
    _TimeProxy,
    policy_spec,
    replay_context,
    servable,
)

from benchmark import description

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

OUT = REPO / "benchmark" / "results" / "eviction_replay_mooncake_two_tier.json"
HOST_LRU = "sae-lru-host"
"""An ablation: ``sae`` on the device tier, its host tier evicted in LRU order instead of the
policy's (``_host_in_lru_order``): what the policy's order on the host tier is worth."""
DEVICE_TOKENS = 500_000  # an H200's KV pool for an 8B model after its weights
HOST_TOKENS = 4_000_000  # a HiCache host tier of ~0.5 TB of host memory at 128 KB a token


class _TokenCountingController:
    """What ``HiRadixCache`` asks of its cache controller, on token counts: write-through copies
    into a host tier of ``host_tokens`` (``None`` when it is full: ``HiRadixCache`` evicts from
    the host tier and asks again), loads back into the device tier while it has room (``None``
    otherwise: it evicts on the device and asks again), and frees. Index values are views of
    one shared range (``simulator._slots``): no decision depends on them."""

    write_policy = "write_through"

    def __init__(self, device_tokens: int, host_tokens: int) -> None:
        self.mem_pool_device_allocator = CountingAllocator()
        self.device_tokens, self.host_tokens = device_tokens, host_tokens
        self.host_used = 0
        self.written = self.loaded = 0
        self.cache = None  # the HiRadixCache, for the device tier's occupancy

    def reset(self) -> None:
        pass

    def device_used(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()

    def write(self, device_indices, node_id, **kwargs):
        n = len(device_indices)
        if self.host_used + n > self.host_tokens:
            return None
        self.host_used += n
        self.written += n
        return _slots(n)

    def load(self, host_indices, node_id, **kwargs):
        n = len(host_indices)
        if self.device_used() + n > self.device_tokens:
            return None
        self.loaded += n
        return _slots(n)

    def evict_device(self, device_indices) -> None:
        pass

    def evict_host(self, host_value) -> int:
        self.host_used -= len(host_value)
        return len(host_value)


def _host_in_lru_order(cache) -> None:
    """This cache's ``evict_host`` (SGLang's, with our hooks) ranks host blocks by last access,
    oldest first, whatever the policy; the device tier keeps the policy's order."""
    evict_host = cache.evict_host

    def lru_evict_host(num_tokens: int, *args, **kwargs):
        strategy = cache.eviction_strategy
        strategy.get_priority = lambda node: node.last_access_time
        try:
            return evict_host(num_tokens, *args, **kwargs)
        finally:
            del strategy.get_priority  # the class's again

    cache.evict_host = lru_evict_host


def make_two_tier_cache(policy: str, device_tokens: int, host_tokens: int):
    """A ``HiRadixCache`` (write-through, page size 1) on ``_TokenCountingController``, built
    without its transfer threads and storage machinery, with ``policy`` (a name of
    ``simulator.policy_spec``) as its eviction strategy."""
    from sglang.srt.mem_cache import hiradix_cache as hc
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    base, attrs = policy_spec("sae" if policy == HOST_LRU else policy)
    controller = _TokenCountingController(device_tokens, host_tokens)
    cache = hc.HiRadixCache.__new__(hc.HiRadixCache)
    cache.cache_controller = controller
    cache.token_to_kv_pool_host = SimpleNamespace(clear=lambda: None)
    cache.prefetch_loaded_tokens_by_reqid = {}
    cache.evictable_host_leaves = set()
    cache.ongoing_write_through, cache.ongoing_load_back = {}, {}
    cache.ongoing_prefetch, cache.ongoing_backup = {}, {}
    cache.write_through_threshold, cache.load_back_threshold = 1, 10  # SGLang's, write_through
    cache.enable_storage = False
    RadixCache.__init__(cache, CacheInitParams(
        disable=False, req_to_token_pool=None,
        token_to_kv_pool_allocator=CountingAllocator(), page_size=1, eviction_policy=base))
    configure(cache.eviction_strategy, attrs)
    controller.cache = cache
    if policy == HOST_LRU:
        _host_in_lru_order(cache)
    return cache, controller


def replay_two_tier(trace: list, policy: str, device_tokens: int, host_tokens: int,
                    split_t: float | None = None) -> dict:
    """Replay ``trace`` (``traces.Request``s in time order) through a two-tier HiCache of
    ``device_tokens`` + ``host_tokens``; returns the token hit rates (whole trace, and before /
    from ``split_t``) with the device / host split, and the host tier's traffic. Requests
    longer than the device tier are left out, as a server refuses them
    (``simulator.servable``), and counted apart."""
    from sglang.srt.mem_cache import hiradix_cache as hc
    from sglang.srt.mem_cache import radix_cache as rc
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import using

    # the device pool holds a running request
    trace, refused, refused_tokens = servable(trace, device_tokens)
    rc.TreeNode.counter = 0
    cache, ctl = make_two_tier_cache(policy, device_tokens, host_tokens)
    clock = _Clock()
    strategy = cache.eviction_strategy
    if hasattr(strategy, "now_fn"):
        strategy.now_fn = clock.monotonic
    prompt = device_hit = host_hit = 0
    parts = {"first": [0, 0], "heldout": [0, 0]}
    wall0 = time.perf_counter()
    with _patched(rc, "time", _TimeProxy(clock)), _patched(hc, "time", _TimeProxy(clock)), \
            _patched(rc.TreeNode, "__hash__", _node_hash):
        for req in trace:
            clock.now = req.t
            with using(replay_context(req)):
                key = RadixKey(token_ids=array("q", req.prompt), extra_key=None)
                match = cache.match_prefix(MatchPrefixParams(key=key))
                on_device, loaded = len(match.device_indices), 0
                lock = match.last_device_node
                if match.host_hit_length > 0:
                    values, node = cache.init_load_back(InitLoadBackParams(
                        best_match_node=match.best_match_node,
                        host_hit_length=match.host_hit_length))
                    loaded = len(values)
                    if loaded:
                        lock = None  # load_back holds its own lock until the load is done
                if lock is not None:
                    cache.inc_lock_ref(lock)
                full = array("q", req.prompt) + array("q", req.output)
                hit = min(on_device + loaded, len(req.prompt))
                need = len(full) - on_device - loaded
                if ctl.device_used() + need > device_tokens:
                    cache.evict(EvictParams(num_tokens=ctl.device_used() + need - device_tokens))
                if device_tokens - ctl.device_used() >= need:
                    cache.insert(InsertParams(key=RadixKey(token_ids=full, extra_key=None),
                                              value=_slots(len(full))))
                for ack in list(cache.ongoing_write_through):
                    cache._finish_write_through_ack(ack, release_lock=True)
                for node in cache.ongoing_load_back.values():  # the load done, as loading_check
                    cache.dec_lock_ref(node)
                cache.ongoing_load_back.clear()
                if lock is not None:
                    cache.dec_lock_ref(lock)
            prompt += len(req.prompt)
            device_hit += min(on_device, len(req.prompt))
            host_hit += hit - min(on_device, len(req.prompt))
            part = parts["heldout" if split_t is not None and req.t >= split_t else "first"]
            part[0] += hit
            part[1] += len(req.prompt)
    events = dict(getattr(strategy, "events", {}))
    return {
        "policy": policy, "size": f"{device_tokens}+{host_tokens}",
        "device_tokens": device_tokens, "host_tokens": host_tokens,
        "requests": len(trace), "prompt_tokens": prompt,
        "token_hit_rate": (device_hit + host_hit) / max(prompt, 1),
        "device_hit_rate": device_hit / max(prompt, 1),
        "host_hit_rate": host_hit / max(prompt, 1),
        "first_hit_rate": parts["first"][0] / max(parts["first"][1], 1),
        "heldout_hit_rate": (parts["heldout"][0] / parts["heldout"][1]
                             if parts["heldout"][1] else None),
        "host_written_tokens": ctl.written, "host_loaded_tokens": ctl.loaded,
        "host_writes_deferred": events.get("host_writes_deferred", 0),
        "refused_requests": len(refused), "refused_prompt_tokens": refused_tokens,
        "wall_s": time.perf_counter() - wall0,
    }


_traces: dict = {}  # (workload, seed) -> trace, set in the parent before the workers fork


def _run(job: tuple[tuple[str, int], str, int, int, float | None]) -> dict:
    (name, seed), policy, device_tokens, host_tokens, split_t = job
    row = replay_two_tier(_traces[name, seed], policy, device_tokens, host_tokens,
                          split_t=split_t)
    return {"workload": name, "seed": seed, **row}


def main() -> None:
    from sglang_pic.eviction.replay.traces import generate, load_mooncake, unique_tokens

    from benchmark.eviction.bench_eviction import REFERENCE, check_policies
    from benchmark.eviction.replay_trace import POLICIES, TRACE, _register, environment

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated eviction policies (default: SGLang's and ours; "
                         f"also {HOST_LRU}, sae with its host tier in LRU order)")
    ap.add_argument("--device-tokens", type=int, default=DEVICE_TOKENS)
    ap.add_argument("--host-tokens", type=int, default=HOST_TOKENS)
    ap.add_argument("--heldout", type=float, default=0.4,
                    help="share of the trace, by time, reported apart (the last part)")
    ap.add_argument("--limit", type=int, default=None, help="replay the first N requests only")
    ap.add_argument("--workloads", default=None,
                    help="generated workloads instead of the trace (e.g. mix,chat,agent,single)")
    ap.add_argument("--fractions", default="0.05,0.2", metavar="DEVICE,HOST",
                    help="--workloads: each tier's size as a share of the trace's unique tokens")
    ap.add_argument("--scale", type=int, default=100, help="--workloads: sessions per workload")
    ap.add_argument("--seeds", type=int, default=1, help="--workloads: seeds per workload")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    policies = check_policies(args.policies, extra=(HOST_LRU,))
    offline = [p for p in policies if p in REFERENCE]
    if offline:  # their oracles are handed the trace by simulator.replay, one tier only
        ap.error(f"--policies {','.join(offline)}: offline references of the one-tier replay "
                 "(replay_trace.py / bench_eviction.py), not replayed in two tiers")
    if args.device_tokens < 1 or args.host_tokens < 0:
        ap.error("--device-tokens must be positive and --host-tokens not negative")
    if not 0 <= args.heldout < 1:
        ap.error("--heldout must be in [0, 1)")
    _register()
    jobs = []
    if args.workloads:
        try:
            device_f, host_f = (float(x) for x in args.fractions.split(","))
        except ValueError:
            ap.error(f"--fractions {args.fractions}: two numbers, DEVICE,HOST")
        if not (0 < device_f and 0 <= host_f):
            ap.error("--fractions: the device share must be positive, the host share not "
                     "negative")
        for name in args.workloads.split(","):
            for seed in range(args.seeds):
                try:
                    trace = generate(name, scale=args.scale, seed=seed)
                except (KeyError, ValueError) as e:
                    ap.error(f"--workloads {name}: {e}")
                key = (name, seed)
                _traces[key] = trace
                uniq = unique_tokens(trace)
                jobs += [(key, p, max(int(device_f * uniq), 1), int(host_f * uniq), None)
                         for p in policies]
        out = Path(args.out) if args.out else OUT.with_name("eviction_two_tier_generated.json")
        config = {"workloads": args.workloads, "fractions": [device_f, host_f],
                  "scale": args.scale, "seeds": args.seeds}
    else:
        if not Path(args.trace).is_file():
            ap.error(f"--trace {args.trace}: no such file")
        trace = load_mooncake(args.trace)[: args.limit]
        _traces["mooncake", 0] = trace
        t_end = trace[-1].t if trace else 0.0
        split_t = t_end * (1 - args.heldout) if args.heldout else None
        jobs = [(("mooncake", 0), p, args.device_tokens, args.host_tokens, split_t)
                for p in policies]
        out = Path(args.out) if args.out else OUT
        config = {"trace": str(args.trace), "limit": args.limit, "heldout": args.heldout,
                  "split_t": split_t, "device_tokens": args.device_tokens,
                  "host_tokens": args.host_tokens}
    print(f"{len(jobs)} replays on {args.workers} worker(s)", flush=True)
    t0, rows = time.perf_counter(), []
    with mp.get_context("fork").Pool(args.workers) as pool:
        for row in pool.imap_unordered(_run, jobs):
            rows.append(row)
            print(f"[{time.perf_counter() - t0:5.0f}s] {row['workload']}:{row['seed']:<4} "
                  f"{row['policy']:<13} hit {row['token_hit_rate']:.4f} (device "
                  f"{row['device_hit_rate']:.4f}, host {row['host_hit_rate']:.4f}); host "
                  f"writes {row['host_written_tokens']}, deferred "
                  f"{row['host_writes_deferred']}", flush=True)
    order = {key: i for i, key in enumerate(_traces)}
    rows.sort(key=lambda r: (order[r["workload"], r["seed"]], policies.index(r["policy"])))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "eviction_replay_two_tier",
                               "environment": environment(), **config, "rows": rows},
                              indent=1))
    print(f"\n{'workload':<14}{'policy':<14}{'hit':>8}{'device':>8}{'host':>8}"
          f"{'held out':>10}{'host writes':>13}")
    for r in rows:
        print(f"{r['workload'] + ':' + str(r['seed']):<14}{r['policy']:<14}{r['token_hit_rate']:>8.4f}"
              f"{r['device_hit_rate']:>8.4f}{r['host_hit_rate']:>8.4f}"
              f"{r['heldout_hit_rate'] or 0:>10.4f}{r['host_written_tokens']:>13}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
