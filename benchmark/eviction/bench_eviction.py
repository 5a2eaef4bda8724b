"""Eviction policies on generated or public traces, replayed through SGLang's RadixCache.

SGLang's seven, GDSF, S3-FIFO, T-LRU, SAE and auto, in one run, with Belady's offline rule (the
whole trace known in advance) as the upper bound.

    .venv/bin/python -m benchmark.eviction.bench_eviction [--scale 100] [--seeds 3] [--quick] [--trace FILE --format mooncake|bailian]

For every workload (chat, agent, single-turn, mix, single-heavy, shift, and chat with
ShareGPT-like turn counts alone and mixed) and cache size (a
fraction of the trace's unique tokens), each policy replays the same trace through SGLang's real
``RadixCache`` (``sglang_pic.eviction.replay.simulator``). Prints a table of token hit rates (and the gain of ``sae``
over the best other policy), writes ``benchmark/results/eviction_sim.json`` and
``docs/figures/eviction_hit_rate.png``; ``--quick`` (a smoke run) writes its JSON to
``$TMPDIR/sglang-pic-bench/`` (``harness.smoke_dir()``) and draws no figure, leaving the tracked
files alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from benchmark import description

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

SGLANG_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
OUR_POLICIES = ("gdsf", "s3fifo", "tlru", "sae", "auto")
# sae without the session predictor / with its gap fits from completed gaps only (the open ones
# not counted, SessionModel._refit_gaps) / with alpha_q / with conversations inferred from the
# prefix chain where requests carry no session (SAEStrategy.on_match) / copying every block to
# HiCache's host tier at once (two_tier.py; the same as sae in one tier) / with every request
# that carries no hints taken as chat, not chat or single by its match (request_guess.RequestGuesser.infer_app)
# auto without the mirror of its leader's shadow / with the fixed switching margin instead of the
# paired test / starting on lru or gdsf instead of sae / with the LeCaR-style regret weights
# (AutoStrategy's options)
ABLATIONS = ("auto-nomirror", "auto-margin", "auto-lru", "auto-gdsf", "auto-regret",
             "auto-greedy", "auto-fast", "auto-greedy-fast",
             "sae-nopred", "sae-uncensored", "sae-alpha", "sae-conv", "sae-copy-all",
             "sae-noapp")
# not policies: the offline bound (simulator.ORACLE), sae told which sessions go on
# (simulator.ENDS_ORACLE), and sae handed the generator's session parameters
# (simulator.PARAMS_ORACLE; generated workloads other than sharegpt* only)
REFERENCE = ("belady", "sae-ends", "sae-params", "sae-conv-ends")
WORKLOADS = ("chat", "agent", "single", "mix", "single_heavy", "shift", "sharegpt",
             "sharegpt_mix")
FRACTIONS = (0.05, 0.1, 0.2, 0.4)


def known_policies() -> tuple[str, ...]:
    """What ``--policies`` accepts: SGLang's seven, ours, the ablations and the references."""
    return SGLANG_POLICIES + OUR_POLICIES + ABLATIONS + REFERENCE


# what a run replays unless told: all but the two for traces without sessions, the one that
# differs from sae only with two tiers and the one that differs only without hints
DEFAULT_POLICIES = tuple(p for p in known_policies()
                         if p not in ("sae-conv", "sae-conv-ends", "sae-copy-all", "sae-noapp",
                                      "auto-nomirror", "auto-margin", "auto-lru", "auto-gdsf",
                                      "auto-regret", "auto-greedy", "auto-fast",
                                      "auto-greedy-fast"))

TLRU_SPEC = "tlru:<xi>:<q_hat>"
"""T-LRU at other settings than the replay's (``simulator.policy_spec``): xi and Q_hat in
tokens, what ``--tlru-threshold`` / ``--tlru-next-prompt-estimate`` set in the server."""


def _bad_tlru_setting(name: str) -> str | None:
    """Why ``tlru:<xi>:<q_hat>`` is refused (None: it is not one, or a good one); the values
    are checked by the server flags' own parser."""
    from sglang_pic.launcher.server_flags import FLAGS, BadValue

    parts = name.split(":")
    if parts[0] != "tlru" or len(parts) == 1:
        return None
    if len(parts) != 3:
        return f"{name!r} is not {TLRU_SPEC}"
    for flag, raw in zip(("--tlru-threshold", "--tlru-next-prompt-estimate"), parts[1:],
                         strict=True):
        try:
            FLAGS[flag].parse(raw)
        except BadValue as e:
            return f"{name!r}: {flag.removeprefix('--tlru-')} {e}"
    return None


def check_policies(spec: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The comma-separated ``--policies`` as a list; an unknown name is refused in one line on
    stderr, exit 2, before anything heavy is imported (a typo used to surface as a KeyError
    from SGLang's policy table after the traces were generated). ``tlru:<xi>:<q_hat>`` names
    T-LRU at those settings; ``extra`` are names the calling replay knows besides these."""
    names = [p.strip() for p in spec.split(",") if p.strip()]
    bad = [why for p in names if (why := _bad_tlru_setting(p))]
    if bad:
        print(f"{Path(sys.argv[0]).name}: {bad[0]} in --policies ({TLRU_SPEC}: tokens, "
              "integers >= 0)", file=sys.stderr)
        sys.exit(2)
    known = known_policies() + extra
    unknown = [p for p in names if p not in known and not p.startswith("tlru:")]
    if unknown or not names:
        what = f"unknown policy {', '.join(map(repr, unknown))}" if unknown else "no policy"
        print(f"{Path(sys.argv[0]).name}: {what} in --policies; known: "
              f"{','.join(known)},{TLRU_SPEC}", file=sys.stderr)
        sys.exit(2)
    return names


def without_hints(req, hints: str):
    """``req`` as the server sees it with fewer hints: no token types (every prompt token
    ``user``, every output token ``decode``) and, with ``hints="none"``, no session or
    application either (``sae`` then tells requesters apart per request)."""
    import dataclasses

    req = dataclasses.replace(req, segments=[(0, "user")], output_segments=[])
    if hints == "none":
        req = dataclasses.replace(req, session_id=None, app_type=None)
    return req


def baselines(policies: list[str]) -> list[str]:
    """The online baselines ``sae`` and ``auto`` are compared with: every policy a server can
    run but those two, ``sae``'s ablations and the offline bounds."""
    return [p for p in policies
            if not p.startswith(("sae", "auto")) and p not in REFERENCE]


def print_summary(rows: list[dict], policies: list[str]) -> None:
    """``sae`` and ``auto`` against the best online baseline per cell, averaged over seeds, and
    the worst cell."""
    ours = [p for p in ("auto", "sae") if p in policies]
    if not ours or not baselines(policies):
        return
    from benchmark.eviction.plot_eviction import mean_rates

    rates = mean_rates(rows)
    print(f"\n{'workload':<13}{'cache':>6}  {'best baseline':<20}"
          + "".join(f"{p:>7}{'gain':>8}" for p in ours))
    worst = dict.fromkeys(ours, float("inf"))
    for w, f in dict.fromkeys((r["workload"], r["fraction"]) for r in rows):
        best = max(baselines(policies), key=lambda p: rates[w, f, p])
        line = f"{w:<13}{f:>6.0%}  {best:<8}{rates[w, f, best]:>12.3f}"
        for p in ours:
            gain = 100 * (rates[w, f, p] - rates[w, f, best])
            worst[p] = min(worst[p], gain)
            line += f"{rates[w, f, p]:>7.3f}{gain:>+7.1f}pp"
        print(line)
    print("worst cell: " + ", ".join(f"{p} {g:+.2f} pp" for p, g in worst.items()))


TABLE_COLUMNS = (("sae-nopred", "sae w/o predictor"), ("sae-alpha", "sae × α_q"),
                 ("sae-params", "sae-params"), ("sae-ends", "sae-ends"), ("belady", "belady"))


def markdown_table(report: dict) -> str:
    """docs/eviction.md's results table from a report: per workload and cache size, the best
    baseline by mean hit rate over the seeds, ``sae``, its gain, the range of its gain over
    each seed's own best baseline, the ablations and references, and the estimated mean TTFT
    of the best baseline and of ``sae``."""
    import statistics

    rows, policies = report["rows"], report["policies"]
    by = {}
    for r in rows:
        by.setdefault((r["workload"], r["fraction"], r["policy"]), {})[r["seed"]] = r
    others = baselines(policies)
    head = ["workload", "cache", "best baseline (mean)", "**sae**", "sae − best", "per seed",
            *(title for p, title in TABLE_COLUMNS if p in policies), "est. TTFT mean, best → sae"]
    out = ["| " + " | ".join(head) + " |",
           "|---|---|---|---:|---:|---|" + "---:|" * (len(head) - 7) + "---|"]

    def mean(w, f, p, key="token_hit_rate"):
        got = by.get((w, f, p))
        return statistics.mean(r[key] for r in got.values()) if got else None

    for w, f in dict.fromkeys((r["workload"], r["fraction"]) for r in rows):
        best = max(others, key=lambda p: mean(w, f, p))
        sae = mean(w, f, "sae")
        per_seed = [100 * (run["token_hit_rate"]
                           - max(by[w, f, p][seed]["token_hit_rate"] for p in others))
                    for seed, run in by[w, f, "sae"].items()]
        cells = [w, f"{f:.0%}".replace("%", " %"), f"{mean(w, f, best):.3f} ({best})",
                 f"**{sae:.3f}**", f"{100 * (sae - mean(w, f, best)):+.1f} pp",
                 f"{min(per_seed):+.1f} .. {max(per_seed):+.1f}"]
        for p, _ in TABLE_COLUMNS:
            if p in policies:
                v = mean(w, f, p)
                cells.append("-" if v is None else f"{v:.3f}")
        cells.append(f"{mean(w, f, best, 'ttft_mean_ms'):.0f} → "
                     f"{mean(w, f, 'sae', 'ttft_mean_ms'):.0f} ms")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--scale", type=int, default=None,
                    help="sessions per workload (size knob; default 100, 20 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="two workloads of 20 sessions, two sizes; writes to "
                         "$TMPDIR/sglang-pic-bench, no plot")
    ap.add_argument("--trace", default=None, help="replay a public trace instead")
    ap.add_argument("--format", choices=("mooncake", "bailian"), default="mooncake")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                    help="comma-separated subset of the default; tlru:<xi>:<q_hat> is T-LRU at "
                         "those settings (tokens)")
    ap.add_argument("--out", default=None,
                    help="results JSON (default benchmark/results/eviction_sim[_hints_X].json)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--table", default=None, metavar="REPORT",
                    help="only print docs/eviction.md's markdown table of an earlier report")
    ap.add_argument("--workloads", default=None, help="comma-separated subset of " +
                    ",".join(WORKLOADS))
    ap.add_argument("--hints", choices=("all", "sessions", "none"), default="all",
                    help="what sae is told: all (sessions, application and token types), "
                         "sessions (no token types: clients sending session hints with raw "
                         "token ids), none (a server getting raw token ids and no hints)")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="the first generator seed (seeds no policy was tuned on: a held-out "
                         "check; the committed results use 0 onwards)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="generate each workload with this many seeds; tables and plot average "
                         "over them (ties in eviction order alone move a cell by ~1 pp)")
    args = ap.parse_args()
    if args.table:
        if not Path(args.table).is_file():
            ap.error(f"--table {args.table}: no such file")
        try:
            table = markdown_table(json.loads(Path(args.table).read_text()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            ap.error(f"--table {args.table}: not a bench_eviction.py report "
                     f"({type(e).__name__}: {e})")
        print(table)
        return

    policies = check_policies(args.policies)
    if args.scale is None:
        args.scale = 20 if args.quick else 100
    elif args.scale < 1:
        ap.error(f"--scale must be at least 1, got {args.scale}")

    import sglang
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import (
        generate,
        load_bailian,
        load_mooncake,
        session_params,
        unique_tokens,
    )
    from sglang_pic.plugin import register_feature

    from benchmark.harness import smoke_dir

    register_feature("eviction")  # our policies and hooks, as the plugin does in a server
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()

    if args.hints == "none":  # no sessions: the session references would be sae itself
        policies = [p for p in policies if p not in ("sae-ends", "sae-params")]
    if args.out is None:
        suffix = "" if args.hints == "all" else f"_hints_{args.hints}"
        # --quick is a smoke run: it must not replace the tracked full results
        folder = Path(smoke_dir()) if args.quick else REPO / "benchmark" / "results"
        args.out = str(folder / f"eviction_sim{suffix}.json")
    if args.trace:
        loader = load_mooncake if args.format == "mooncake" else load_bailian
        workloads = {(Path(args.trace).stem, 0): loader(args.trace)}
    else:
        names = ("mix", "single_heavy") if args.quick else WORKLOADS
        if args.workloads:
            names = tuple(args.workloads.split(","))
        workloads = {(w, seed): generate(w, scale=args.scale, seed=seed) for w in names
                     for seed in range(args.first_seed, args.first_seed + args.seeds)}
    if args.hints != "all":
        workloads = {k: [without_hints(r, args.hints) for r in trace]
                     for k, trace in workloads.items()}
    fractions = (0.1, 0.2) if args.quick else FRACTIONS
    rows = []
    t_start = time.perf_counter()
    for (wname, seed), trace in workloads.items():
        uniq = unique_tokens(trace)
        try:
            params = None if args.trace else session_params(wname)
        except ValueError:
            params = None
        todo = [p for p in policies if p != "sae-params" or params is not None]
        for frac in fractions:
            cap = max(int(uniq * frac), 1024)
            line = []
            for pol in todo:
                res = replay(trace, pol, cap, session_params=params).summary()
                res.update(workload=wname, seed=seed, fraction=frac, unique_tokens=uniq)
                rows.append(res)
                line.append(f"{pol} {res['token_hit_rate']:.3f}")
            others = baselines(policies)
            best_other = max((r["token_hit_rate"] for r in rows[-len(todo):]
                              if r["policy"] in others), default=0.0)
            sae = next((r for r in rows[-len(todo):] if r["policy"] == "sae"), None)
            gain = f"  sae-best={100 * (sae['token_hit_rate'] - best_other):+.1f}pp" if sae else ""
            print(f"[{time.perf_counter() - t_start:5.0f}s] {wname:<12} s{seed} cap {frac:>4.0%} "
                  f"({cap} tok, {len(trace)} req): " + "  ".join(line) + gain, flush=True)
    report = {"benchmark": "eviction_sim", "environment": {
        "host": platform.node(), "python": platform.python_version(),
        "sglang": sglang.__version__, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ")},
        "scale": args.scale, "seeds": args.seeds, "first_seed": args.first_seed,
        "hints": args.hints,
        "policies": policies, "rows": rows}
    print_summary(rows, policies)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    # the figure in docs is the full run's with all hints (plot() writes docs/figures)
    if not args.no_plot and not args.quick and args.hints == "all":
        from benchmark.eviction.plot_eviction import plot

        print(plot(out))


if __name__ == "__main__":
    main()
