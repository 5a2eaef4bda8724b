"""Request traces for the eviction simulator: synthetic generators and public-trace loaders.

A trace is a list of :class:`Request` sorted by arrival time. Token ids are synthetic but
*content-faithful*: two requests share a token run exactly when they share content (a system
prompt, a chat history, a document), so radix-cache hits are what a real server would see.

Generators (lengths in tokens, times in seconds; distributions as reported for ShareGPT/LMSys
chat and agent traces, parameters in each function's signature):
- ``chat``: sessions over a few shared system prompts; turns with log-normal user/assistant
  lengths and log-normal think-time gaps; each turn resends the whole history.
- ``agent``: sessions over shared tool-definition prefixes; steps append tool outputs; outputs
  are chain-of-thought (never resent) + a tool call (resent); short gaps.
- ``single``: templated single-turn requests: a shared template + a unique query.
- ``mix`` of the three, and ``shift`` (chat-heavy first half, agent/single-heavy second half).

Loaders: Mooncake (FAST'25) JSONL with ``hash_ids`` (512-token blocks) and Qwen-Bailian JSONL with
``chat_id`` / ``parent_chat_id`` / ``turn``.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Request:
    t: float
    session_id: str | None
    app_type: str
    prompt: Sequence[int]  # a list, or an array('q') for block traces (load_mooncake)
    output: Sequence[int]
    segments: list[tuple[int, str]] = field(default_factory=list)
    output_segments: list[tuple[int, str]] = field(default_factory=list)
    blocks: tuple[int, ...] | None = None  # the trace's block hash ids, where it has them


class _Ids:
    """Fresh token ids for new content."""

    def __init__(self, start: int = 1000) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _lognormal(rng, median: float, sigma: float, lo: int = 1, hi: int = 8192) -> int:
    return int(min(max(rng.lognormal(np.log(median), sigma), lo), hi))


def chat(n_sessions: int, rng, ids: _Ids, t0: float = 0.0, rate: float = 0.5,
         n_system: int = 4, system_len: int = 400, turns_mean: float = 4.0,
         user_median: float = 60, reply_median: float = 220, gap_median: float = 45.0,
         gap_sigma: float = 1.0, one_shot: float = 0.0) -> list[Request]:
    """Chat sessions. Turns per session: geometric with mean ``turns_mean`` (memoryless: every
    turn is followed by another with the same chance), or with ``one_shot > 0`` ShareGPT/LMSys-
    like, where a ``one_shot`` share of conversations stop after their first turn and the rest
    run ``1 + geometric(turns_mean)`` turns - so whether a session goes on depends on how long
    it already is, as in real chat logs."""
    systems = [ids.take(_lognormal(rng, system_len, 0.3)) for _ in range(n_system)]
    out, t = [], t0
    for s in range(n_sessions):
        t += rng.exponential(1.0 / rate)
        sid = f"chat-{t0:.0f}-{s}"
        system = systems[rng.integers(n_system)]
        history: list[int] = list(system)
        segments: list[tuple[int, str]] = [(0, "system")]
        now = t
        if one_shot > 0:
            turns = 1 if rng.random() < one_shot else 1 + rng.geometric(1.0 / turns_mean)
        else:
            turns = max(1, rng.geometric(1.0 / turns_mean))
        for _ in range(turns):
            user = ids.take(_lognormal(rng, user_median, 1.0))
            segments.append((len(history), "user"))
            prompt = history + user
            reply = ids.take(_lognormal(rng, reply_median, 0.8))
            out.append(Request(now, sid, "chat", prompt, reply, list(segments)))
            segments.append((len(prompt), "assistant"))
            history = prompt + reply
            now += rng.lognormal(np.log(gap_median), gap_sigma)
    return out


AGENT_GAP_SIGMA = 0.8


def agent(n_sessions: int, rng, ids: _Ids, t0: float = 0.0, rate: float = 0.3,
          n_tools: int = 3, tools_len: int = 1500, steps_mean: float = 8.0,
          tool_out_median: float = 400, cot_median: float = 300, call_median: float = 60,
          gap_median: float = 3.0) -> list[Request]:
    tools = [ids.take(_lognormal(rng, tools_len, 0.3)) for _ in range(n_tools)]
    out, t = [], t0
    for s in range(n_sessions):
        t += rng.exponential(1.0 / rate)
        sid = f"agent-{t0:.0f}-{s}"
        tool_defs = tools[rng.integers(n_tools)]
        history = list(tool_defs) + ids.take(_lognormal(rng, 150, 0.5))
        segments: list[tuple[int, str]] = [(0, "system"), (len(tool_defs), "user")]
        now = t
        for _ in range(max(1, rng.geometric(1.0 / steps_mean))):
            cot = ids.take(_lognormal(rng, cot_median, 0.7))
            call = ids.take(_lognormal(rng, call_median, 0.5))
            out.append(Request(now, sid, "agent", list(history), cot + call, list(segments),
                               [(0, "cot"), (len(cot), "decode")]))
            segments.append((len(history), "assistant"))
            history = history + call
            segments.append((len(history), "tool"))
            history = history + ids.take(_lognormal(rng, tool_out_median, 1.0))
            now += rng.lognormal(np.log(gap_median), AGENT_GAP_SIGMA)
    return out


def session_params(kind: str) -> dict[str, tuple[float, float, float]]:
    """What the generators draw sessions from, per application type, for workloads whose
    sessions all come from ``chat`` / ``agent`` with their default arguments (not the
    ``sharegpt*`` ones): (median gap s, sigma of log gap, P(another request) after any request).
    The replay's ``sae-params`` hands these to ``sae`` to measure what learning them costs."""
    import inspect

    if kind.startswith("sharegpt"):
        raise ValueError("sharegpt sessions' continuation depends on their turn count")
    c = {k: v.default for k, v in inspect.signature(chat).parameters.items()}
    a = {k: v.default for k, v in inspect.signature(agent).parameters.items()}
    return {"chat": (c["gap_median"], c["gap_sigma"], 1.0 - 1.0 / c["turns_mean"]),
            "agent": (a["gap_median"], AGENT_GAP_SIGMA, 1.0 - 1.0 / a["steps_mean"])}


def single(n_requests: int, rng, ids: _Ids, t0: float = 0.0, rate: float = 2.0,
           n_templates: int = 6, template_len: int = 800, query_median: float = 120,
           output_median: float = 120) -> list[Request]:
    templates = [ids.take(_lognormal(rng, template_len, 0.4)) for _ in range(n_templates)]
    weights = 1.0 / np.arange(1, n_templates + 1)
    weights /= weights.sum()
    out, t = [], t0
    for _ in range(n_requests):
        t += rng.exponential(1.0 / rate)
        tpl = templates[rng.choice(n_templates, p=weights)]
        prompt = list(tpl) + ids.take(_lognormal(rng, query_median, 0.8))
        out.append(Request(t, None, "single", prompt, ids.take(_lognormal(rng, output_median, 0.6)),
                           [(0, "system"), (len(tpl), "user")]))
    return out


def generate(kind: str, scale: int = 100, seed: int = 0) -> list[Request]:
    """A named workload: chat | agent | single | mix | single_heavy | shift | sharegpt |
    sharegpt_mix (``sharegpt*``: chat with ShareGPT-like turn counts, 45 % one-shot)."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    if kind == "chat":
        reqs = chat(scale, rng, ids)
    elif kind == "agent":
        reqs = agent(scale // 2, rng, ids)
    elif kind == "single":
        reqs = single(scale * 4, rng, ids)
    elif kind == "mix":
        reqs = chat(scale // 2, rng, ids) + agent(scale // 4, rng, ids) + single(scale * 2, rng, ids)
    elif kind == "single_heavy":
        reqs = single(scale * 5, rng, ids) + chat(scale // 10, rng, ids)
    elif kind == "shift":
        first = chat(scale // 2, rng, ids) + single(scale // 2, rng, ids)
        end = max(r.t for r in first)
        reqs = first + agent(scale // 3, rng, ids, t0=end) + single(scale * 2, rng, ids, t0=end)
    elif kind == "sharegpt":
        reqs = chat(scale * 2, rng, ids, one_shot=0.45)
    elif kind == "sharegpt_mix":
        reqs = (chat(scale, rng, ids, one_shot=0.45) + agent(scale // 4, rng, ids)
                + single(scale * 2, rng, ids))
    else:
        raise ValueError(f"unknown workload {kind!r}")
    return sorted(reqs, key=lambda r: r.t)


def _block_tokens(hash_id: int, n: int = 512) -> list[int]:
    return [int(hash_id) * 512 + j + 1_000_000 for j in range(n)]


MOONCAKE_BLOCK = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces."""


def _block_prompt(hash_ids: list[int], length: int) -> array:
    """The prompt of a Mooncake record as token ids: block ``h`` is tokens
    ``h * 512 + 1_000_000 + [0, 512)`` (what ``_block_tokens`` gives, built in numpy and kept as
    an ``array('q')``: the whole conversation trace is 145M prompt tokens, 1.2 GB this way
    against ~5 GB as Python lists of ints)."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    toks = (ids[:, None] * MOONCAKE_BLOCK + 1_000_000
            + np.arange(MOONCAKE_BLOCK, dtype=np.int64)[None, :]).ravel()[:length]
    return array("q", toks.tobytes())


def _mooncake_record(line: str) -> tuple[float, list[int], int, int]:
    """(time s, hash ids, input length, output length) of one JSONL line; ValueError (with the
    reason) if the line is not a well-formed record."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids")
               if k not in rec]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    ids = rec["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                            and h >= 0 for h in ids):
        raise ValueError("hash_ids is not a list of non-negative integers")
    try:
        t = float(rec["timestamp"]) / 1000.0
        n_in, n_out = int(rec["input_length"]), int(rec["output_length"])
    except (TypeError, ValueError):
        raise ValueError("timestamp / input_length / output_length not numbers") from None
    if not np.isfinite(t) or n_in < 0 or n_out < 0:
        raise ValueError("negative length or non-finite timestamp")
    if n_in > len(ids) * MOONCAKE_BLOCK:
        raise ValueError(f"input_length {n_in} > {len(ids)} blocks x {MOONCAKE_BLOCK}")
    return t, ids, n_in, n_out


def load_mooncake(path: str | Path, compact: bool = True) -> list[Request]:
    """Mooncake FAST'25 traces: JSONL with ``timestamp`` (ms), ``input_length``,
    ``output_length``, ``hash_ids`` (one id per 512-token block of the prompt, prefix-chained).

    A malformed line (not JSON, a missing field, bad values) is reported on stderr with its
    line number and skipped, and the count of skipped lines is printed at the end: one bad line
    in a 12K-request trace should cost that request, not the replay. Each request keeps its
    ``blocks``; ``compact`` stores prompts as ``array('q')`` (same tokens as lists, a quarter
    of the memory, built in numpy); ``compact=False`` builds Python lists as the loader did
    before (the reference the fast path is tested against). Outputs are unique per request
    (negative ids): they are cached after their prompt but never resent. No session or
    application type: what a server sees from token ids alone."""
    reqs, skipped = [], 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                t, ids, n_in, n_out = _mooncake_record(line)
            except ValueError as e:
                skipped += 1
                print(f"{path}:{lineno}: skipped malformed trace line: {e}", file=sys.stderr)
                continue
            if compact:
                prompt: list[int] | array = _block_prompt(ids, n_in)
            else:
                prompt = []
                for h in ids:
                    prompt += _block_tokens(h)
                prompt = prompt[:n_in]
            base = -(len(reqs) << 20) - 1
            out = array("q", range(base, base - n_out, -1)) if compact else list(
                range(base, base - n_out, -1))
            reqs.append(Request(t, None, None, prompt, out, [(0, "user")],
                                blocks=tuple(ids)))
    if skipped:
        print(f"{path}: skipped {skipped} malformed line(s), replaying {len(reqs)} requests",
              file=sys.stderr)
    return sorted(reqs, key=lambda r: r.t)


def unique_tokens(trace: list[Request]) -> int:
    """Distinct token ids in the trace's prompts and outputs: the size of a cache that never
    evicts. For block traces (every request has ``blocks``) counted per block - block ``h``
    contributes the most of its tokens any prompt uses - instead of a set of 145M ints."""
    if trace and all(r.blocks is not None for r in trace):
        used: dict[int, int] = {}
        outputs = 0
        for r in trace:
            n = len(r.prompt)
            for i, h in enumerate(r.blocks):
                k = min(MOONCAKE_BLOCK, n - i * MOONCAKE_BLOCK)
                if k <= 0:
                    break
                if used.get(h, 0) < k:
                    used[h] = k
            outputs += len(r.output)  # unique per request
        return sum(used.values()) + outputs
    seen: set[int] = set()
    for r in trace:
        seen.update(r.prompt)
        seen.update(r.output)
    return len(seen)


def load_bailian(path: str | Path) -> list[Request]:
    """Qwen-Bailian traces: JSONL with ``chat_id``, ``parent_chat_id`` (-1 for a first turn),
    ``turn``, ``timestamp`` (s), ``input_length``, ``output_length`` and ``hash_ids``; a session is
    the chain of chats linked by ``parent_chat_id``; ``type`` (if present) names the app."""
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    root: dict = {}
    for rec in sorted(recs, key=lambda r: r.get("turn", 0)):
        parent = rec.get("parent_chat_id", -1)
        root[rec["chat_id"]] = root.get(parent, rec["chat_id"]) if parent != -1 else rec["chat_id"]
    reqs = []
    for rec in recs:
        prompt: list[int] = []
        for h in rec.get("hash_ids", []):
            prompt += _block_tokens(h, 16)
        prompt = prompt[: int(rec["input_length"])]
        app = rec.get("type") or ("chat" if rec.get("turn", 1) > 1 else "single")
        out = list(range(-1, -int(rec["output_length"]) - 1, -1))
        reqs.append(Request(float(rec["timestamp"]), str(root[rec["chat_id"]]),
                            "agent" if "agent" in str(app) else app, prompt, out, [(0, "user")]))
    return sorted(reqs, key=lambda r: r.t)
