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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Request:
    t: float
    session_id: str | None
    app_type: str
    prompt: list[int]
    output: list[int]
    segments: list[tuple[int, str]] = field(default_factory=list)
    output_segments: list[tuple[int, str]] = field(default_factory=list)


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


def load_mooncake(path: str | Path) -> list[Request]:
    """Mooncake FAST'25 traces: JSONL with ``timestamp`` (ms), ``input_length``,
    ``output_length``, ``hash_ids`` (one id per 512-token block of the prompt)."""
    reqs = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        prompt: list[int] = []
        for h in rec["hash_ids"]:
            prompt += _block_tokens(h)
        prompt = prompt[: int(rec["input_length"])]
        out = list(range(-1, -int(rec["output_length"]) - 1, -1))  # unique, never resent
        reqs.append(Request(float(rec["timestamp"]) / 1000.0, None, "single", prompt, out,
                            [(0, "user")]))
    return sorted(reqs, key=lambda r: r.t)


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
