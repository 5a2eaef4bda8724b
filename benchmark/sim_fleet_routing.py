"""How the router's policies spread span requests over a fleet, simulated over the RAG grid.

A span fleet (``sglang-pic fleet --enable-span-cache`` with PTStore) serves a request's
documents and system prompt from three places: the instance's own KV cache (a local hit), the
store (computed before on another instance, or evicted here: a load), or a prefill (never seen).
Which one depends on where the router sends the request. This script replays the cells of
``bench_rag_grid.py`` through a model of each policy and counts the prompt tokens of each
source, so the policies can be compared over the whole family of workloads (cells, fleet sizes,
cache sizes) before a GPU measures a few of them (``bench_fleet_rag.py``).

The model:

* each instance caches whole units (a tenant's system prompt, a document) with LRU eviction, up
  to ``cache`` x the tokens of the pool and system prompts; the store holds every unit ever
  computed (PTStore's tier is host memory across nodes, much larger than a GPU's pool);
* ``round_robin``: the router's rotation;
* ``cache_aware``: the router's rule (sglang-router 0.3.2): the worker whose tree holds the
  longest prefix of the prompt, if it covers more than ``--cache-threshold`` (0.3) of it, else
  the worker whose tree is smallest; the trees hold every prompt routed (their eviction, at
  2^24 tokens by default, is not modelled) and match whole units (a request's documents come
  sorted, as ``bench_fleet_rag.py`` sends them);
* ``span``: ``--policy manual`` with the span routing key (``sglang_pic.fleet.routing``, the
  real function, over the real prompts); a new key goes to a random worker (``random``, the
  router's default ``--assignment-mode``) or to the worker with the fewest keys assigned
  (``min_group`` as if it counted assigned keys: the router counts keys in flight, which a
  sequential replay never has, so this is its behaviour under steady concurrent load);
* ``span_partition``: the same with the key naming the group (one per instance) holding most of
  the request's document tokens, keys assigned ``min_group``: the documents are partitioned
  over the instances;
* requests arrive one at a time: the router's load balancing (shortest queue when loads differ
  by more than 64 requests and 1.5x) does not act on a sequential replay, so ``cache_aware``'s
  spread is what its tree decides.

Reported per cell, fleet size, cache size and policy: the share of unit tokens that were local
hits, store loads and prefills, and the busiest instance's share of requests over the mean.

    python3 -m benchmark.sim_fleet_routing                # the grid's cells, 2/4/8 instances
    python3 -m benchmark.sim_fleet_routing --quick        # one cell, small: a CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

from sglang_pic.fleet.routing import independent_spans, key_of_spans, span_digest, span_routing_key

from benchmark import description
from benchmark.bench_rag_grid import CELLS, PARAMS, SSEP, draw_requests, prompt
from benchmark.harness import environment, smoke_dir

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("round_robin", "cache_aware", "span_random", "span_min_group", "span_partition")
CACHE_THRESHOLD = 0.3  # sglang-router's --cache-threshold default


class Instance:
    """One instance's cache of units (LRU by tokens) and the router's tree of its prompts."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.lru: OrderedDict[tuple, int] = OrderedDict()
        self.tree: dict = {}  # unit -> subtree: the prompts routed here, as unit sequences
        self.tree_tokens = 0
        self.requests = 0

    def serve(self, units: list[tuple[tuple, int]], computed: set) -> dict[str, int]:
        """Tokens of ``units`` found here, loaded from the store, and prefilled."""
        out = {"local": 0, "store": 0, "prefill": 0}
        for unit, n in units:
            if unit in self.lru:
                out["local"] += n
                self.lru.move_to_end(unit)
                continue
            out["store" if unit in computed else "prefill"] += n
            computed.add(unit)
            self.lru[unit] = n
            self.used += n
            while self.used > self.capacity and len(self.lru) > 1:
                _, m = self.lru.popitem(last=False)
                self.used -= m
        self.requests += 1
        return out

    def matched(self, units: list[tuple[tuple, int]]) -> int:
        """Tokens of the longest unit prefix of ``units`` in this instance's tree."""
        node, tokens = self.tree, 0
        for unit, n in units:
            if unit not in node:
                break
            node, tokens = node[unit], tokens + n
        return tokens

    def remember(self, units: list[tuple[tuple, int]]) -> None:
        node = self.tree
        for unit, n in units:
            if unit not in node:
                node[unit] = {}
                self.tree_tokens += n
            node = node[unit]


def route(policy: str, fleet: list[Instance], units, ids_of, spans, state: dict, rng) -> int:
    """The instance ``policy`` sends a request to (``units``: its system prompt and documents
    with their tokens; ``spans``: its documents' (digest, bytes); ``ids_of()``: its prompt, built
    only for the first requests, whose keys are checked against the real function)."""
    if policy == "round_robin":
        state["next"] = (state.get("next", -1) + 1) % len(fleet)
        return state["next"]
    if policy == "cache_aware":
        total = sum(n for _, n in units)
        matches = [inst.matched(units) for inst in fleet]
        best = max(range(len(fleet)), key=matches.__getitem__)
        if matches[best] > CACHE_THRESHOLD * total:
            return best
        return min(range(len(fleet)), key=lambda i: fleet[i].tree_tokens)
    buckets = len(fleet) if policy == "span_partition" else None
    key = key_of_spans(spans, buckets)
    if state.setdefault("checked", 0) < 20:  # the shortcut is the real function's answer
        assert key == span_routing_key(ids_of(), buckets=buckets)
        state["checked"] += 1
    owners = state.setdefault("owners", {})
    if key not in owners:
        if policy == "span_random":
            owners[key] = int(rng.integers(len(fleet)))
        else:  # min_group: the worker holding the fewest keys
            counts = [0] * len(fleet)
            for w in owners.values():
                counts[w] += 1
            owners[key] = min(range(len(fleet)), key=counts.__getitem__)
    return owners[key]


def simulate(cell_name: str, instances: int, cache: float, policy: str, params: dict,
             seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng([seed, sorted(CELLS).index(cell_name)])
    draw = draw_requests(rng, CELLS[cell_name], params["requests"], params)
    unique = sum(len(d) for d in draw["pool"]) + sum(len(s) for s in draw["systems"])
    fleet = [Instance(int(cache * unique)) for _ in range(instances)]
    computed: set = set()
    totals = {"local": 0, "store": 0, "prefill": 0}
    state: dict = {}
    route_rng = np.random.default_rng(seed)
    # each document's (digest, bytes) as the routing key sees it, hashed once
    digests = [(span_digest(c), len(c))
               for c in independent_spans([x for d in draw["pool"] for x in (SSEP, *d)])]
    for request in draw["requests"]:
        tenant, docs, _ = request
        units = [(("system", tenant), len(draw["systems"][tenant]))]
        units += [(("doc", d), len(draw["pool"][d])) for d in docs]
        spans = [digests[d] for d in docs]
        i = route(policy, fleet, units, lambda r=request: prompt(draw, r, True), spans, state,
                  route_rng)
        if policy == "cache_aware":
            fleet[i].remember(units)
        for k, v in fleet[i].serve(units, computed).items():
            totals[k] += v
    served = sum(totals.values())
    counts = [inst.requests for inst in fleet]
    return {"cell": cell_name, "instances": instances, "cache": cache, "policy": policy,
            "seed": seed, "unique_tokens": unique, "requests": len(draw["requests"]),
            **{f"{k}_share": v / served for k, v in totals.items()},
            "busiest_over_mean": max(counts) / statistics.mean(counts),
            "per_instance": counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None, help="results folder (default benchmark/results)")
    ap.add_argument("--cells", default="aligned,varlen_k6_p256_z07_t4,varlen_k10_p1024_z11_t4,"
                                        "varlen_k10_p256_z11_t1,fixed_k6_p1024_z07_t4")
    ap.add_argument("--instances", default="2,4,8")
    ap.add_argument("--caches", default="0.1,0.25,0.5",
                    help="each instance's cache, a share of the pool's and prompts' tokens")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--quick", action="store_true", help="one cell, small: a check")
    ap.add_argument("--plot", default=None,
                    help="the figure (default docs/figures/fleet_routing_sim.png; none with "
                         "--quick unless given)")
    ap.add_argument("--from-report", default=None,
                    help="plot and print an earlier report instead of simulating")
    args = ap.parse_args()
    cells = args.cells.split(",")
    if set(cells) - set(CELLS):
        ap.error(f"unknown cells: {sorted(set(cells) - set(CELLS))}")
    instances = [int(x) for x in args.instances.split(",")]
    caches = [float(x) for x in args.caches.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    if args.quick:
        cells, instances, caches, seeds = ["varlen_k6_p256_z07_t4"], [2], [0.25], [1]
        args.requests = 200
        args.out = args.out or smoke_dir()
    if args.from_report:
        report = json.loads(Path(args.from_report).read_text())
        print_table(report["summary"])
        plot(report["summary"], Path(args.plot or REPO / "docs/figures/fleet_routing_sim.png"))
        return
    params = {**PARAMS, "requests": args.requests}
    rows, t0 = [], time.perf_counter()
    total = len(cells) * len(instances) * len(caches) * len(seeds)
    done = 0
    for cell in cells:
        for n in instances:
            for cache in caches:
                for seed in seeds:
                    for policy in POLICIES:
                        rows.append(simulate(cell, n, cache, policy, params, seed))
                    done += 1
                    print(f"[sim-routing] {done}/{total} {cell} x{n} cache {cache}: "
                          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    summary = summarize(rows)
    print_table(summary)
    out_dir = Path(args.out) if args.out else REPO / "benchmark" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("fleet_routing_sim_quick.json" if args.quick else "fleet_routing_sim.json")
    path.write_text(json.dumps({"benchmark": "sim_fleet_routing", "environment": environment(),
                                "config": {"cells": cells, "instances": instances,
                                           "caches": caches, "seeds": seeds,
                                           "requests": args.requests,
                                           "cache_threshold": CACHE_THRESHOLD},
                                "params": params, "rows": rows, "summary": summary}, indent=1))
    print(f"[bench] wrote {path}")
    if args.plot or not args.quick:
        plot(summary, Path(args.plot or REPO / "docs/figures/fleet_routing_sim.png"))


def plot(summary: list[dict], path: Path) -> None:
    """Per cell (columns): each policy's local share (top) and busiest instance over the mean
    (bottom) against the fleet size, at each cache size (line style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({s["cell"] for s in summary})
    caches = sorted({s["cache"] for s in summary})
    colours = dict(zip(POLICIES, ("tab:gray", "tab:blue", "tab:orange", "tab:red",
                                  "tab:green"), strict=True))
    styles = dict(zip(caches, ("-", "--", ":", "-."), strict=False))
    fig, axes = plt.subplots(2, len(cells), figsize=(3.2 * len(cells), 6), squeeze=False)
    for j, cell in enumerate(cells):
        for policy in POLICIES:
            for cache in caches:
                pts = sorted((s["instances"], s["local_share"], s["busiest_over_mean"])
                             for s in summary if s["cell"] == cell and s["policy"] == policy
                             and s["cache"] == cache)
                if not pts:
                    continue
                n, local, busy = zip(*pts, strict=True)
                label = policy if cache == caches[0] else None
                axes[0][j].plot(n, local, styles[cache], color=colours[policy], label=label)
                axes[1][j].plot(n, busy, styles[cache], color=colours[policy])
        axes[0][j].set_title(cell, fontsize=8)
        axes[1][j].set_xlabel("instances")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
    axes[0][0].set_ylabel("tokens from the instance's cache")
    axes[1][0].set_ylabel("busiest instance / mean")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Routing span requests (model): caches of "
                 + ", ".join(f"{c:.0%} ({styles[c]})" for c in caches)
                 + " of the documents' tokens", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"[bench] wrote {path}")


def summarize(rows: list[dict]) -> list[dict]:
    """Per cell, fleet size and cache: each policy's shares, the mean over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["cell"], r["instances"], r["cache"], r["policy"]), []).append(r)
    out = []
    for (cell, n, cache, policy), rs in groups.items():
        out.append({"cell": cell, "instances": n, "cache": cache, "policy": policy,
                    **{k: statistics.mean(r[k] for r in rs)
                       for k in ("local_share", "store_share", "prefill_share",
                                 "busiest_over_mean")},
                    "local_share_min": min(r["local_share"] for r in rs),
                    "local_share_max": max(r["local_share"] for r in rs)})
    return out


def print_table(summary: list[dict]) -> None:
    print(f"{'cell':<26}{'n':>3}{'cache':>7}  {'policy':<16}{'local':>7}{'store':>7}"
          f"{'prefill':>8}{'busiest':>9}")
    for s in summary:
        print(f"{s['cell']:<26}{s['instances']:>3}{s['cache']:>7.2f}  {s['policy']:<16}"
              f"{s['local_share']:>7.3f}{s['store_share']:>7.3f}{s['prefill_share']:>8.3f}"
              f"{s['busiest_over_mean']:>9.2f}")


if __name__ == "__main__":
    main()
