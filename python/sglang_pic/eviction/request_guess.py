"""What ``sae`` guesses about a request that carries no hints: its conversation and its
application.

Why: ``sae`` scores a block by its application's reuse rate and by when its conversation comes
back, which a server only knows when clients say so (session hints, ``openai_hints``). Raw
token ids say neither, but a request's match in the radix tree says a little: a request that
goes on from where an earlier one ended is a conversation's next turn; one that branches off a
block many requests went on past (a system prompt, a template) is a single-turn query on it.

``RequestGuesser`` keeps what that takes: the conversations inferred (off by default: what a
server sees does not tell which inferred conversations get another turn, so the session index
over them keeps less than plain ``sae``, the replay's ``sae-conv``), the applications guessed
(the replay's ``sae-noapp`` turns them off), and the numbers of the shared blocks requests
branched off (anchors), whose reuse rates ``sae`` learns apart. The server builds a new
request context per insert call; ``resolve`` hands a later one what was guessed for the
request. Nodes are read through their ``sae`` attribute (``sae.BlockInfo``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from .context import RequestContext, block_key, block_offset

TRACKED_REQUESTS = 4096
"""Requests (SGLang rids) whose conversation or application was guessed, remembered for their
later inserts."""


class RequestGuesser:
    """The conversation and application of requests without hints (``infer_sessions``: guess
    conversations; ``infer_apps``: guess applications), with at most ``tracked_sessions``
    conversations and ``tracked_anchor_ids`` anchor numbers remembered."""

    def __init__(self, tracked_sessions: int, tracked_anchor_ids: int) -> None:
        self.tracked_sessions = tracked_sessions
        self.tracked_anchor_ids = tracked_anchor_ids
        self.infer_sessions = False
        self.block_attr = "sae"  # where the policy's ``BlockInfo`` sits on a node
        self.infer_apps = True
        # the match depth of each inferred conversation's latest request, and the conversation
        # of each request id seen
        self.conv_depth: OrderedDict[str, int] = OrderedDict()
        self.conv_of: OrderedDict[str, str] = OrderedDict()
        # (application, the shared block it branched off or None) per request id
        self.app_of: OrderedDict[str, tuple[str, int | None]] = OrderedDict()
        # each anchor's number, by its ``block_key``: blocks carry the number, so that scoring
        # a block hashes a short tuple, not the anchor's 32 token ids
        self.anchor_ids: OrderedDict[tuple, int] = OrderedDict()
        self._anchor_serial = itertools.count()

    def on_match(self, nodes: list, ctx: RequestContext, tokens: Any, ghost: Mapping) -> None:
        """Infer the conversation of a request that came without a session, from its match
        (``nodes``: the matched path, deepest first; ``tokens``: the request's token ids;
        ``ghost``: ``sae``'s evicted blocks by ``block_key``), before its other events.

        A conversation resends its history, so its next request matches down the path of its
        latest one and goes deeper than that one's own match did. The request joins the
        conversation of the deepest block it matched when (1) that block is used by one
        requester only (not ``structural``: a block many conversations open with, a system
        prompt, says nothing about which one this is) and (2) the match goes deeper than the
        match of that conversation's latest request: a second request that stops where the
        latest one also stopped branches off a shared template, not off the conversation's
        end. Where the match stops because the conversation's next block was evicted, the
        ghost set still knows whose it was (the request's tokens after the match are that
        block's first tokens): the request joins that conversation, and its next request must
        match deeper than the evicted block reached. Otherwise it opens a conversation of its
        own. The conversation is then its session (the session index, gap fit and
        continuation odds apply) and its requester. A client's session id or an application
        type of ``single`` wins: nothing is inferred."""
        if self.infer_apps and not self.infer_sessions:
            self.infer_app(nodes, ctx)
        if (not self.infer_sessions or ctx.session_id is not None or ctx.on_behalf
                or ctx.app_type == "single"):
            return
        if ctx.rid is not None and ctx.rid in self.conv_of:
            ctx.session_id = self.conv_of[ctx.rid]
            return
        depth, conv, reach = 0, None, 0
        if nodes:
            deepest = nodes[0]
            depth = block_offset(deepest) + len(deepest.key)
            info = getattr(deepest, self.block_attr, None)
            if (info is not None and info.session_id is not None and info.queue != "structural"
                    and depth > self.conv_depth.get(info.session_id, depth)):
                conv, reach = info.session_id, depth
        if conv is None and tokens is not None and len(tokens) > depth:
            ghost = ghost.get((depth, tuple(tokens[depth:depth + 32])))
            if ghost is not None and ghost[2] is not None:
                conv, reach = ghost[2], ghost[3]
        if conv is None:
            conv, reach = f"~{ctx.requester}", depth
        ctx.session_id = conv
        self.conv_depth.pop(conv, None)
        self.conv_depth[conv] = reach
        if len(self.conv_depth) > self.tracked_sessions:
            self.conv_depth.popitem(last=False)
        if ctx.rid is not None:
            self.conv_of[ctx.rid] = conv
            if len(self.conv_of) > TRACKED_REQUESTS:
                self.conv_of.popitem(last=False)

    def infer_app(self, nodes: list, ctx: RequestContext) -> None:
        """The application of a request that came with neither a session nor an application
        type, from its match: ``chat`` when it goes on from where an earlier request ended
        (the deepest block it matched has at most one request gone on past it: a
        conversation's history, an agent's last step), ``single`` when it branches off a
        block several requests went on past (a system prompt, a template) or matched nothing.

        Without it every such block is ``chat``, and one reuse rate ``w`` per token type
        covers a conversation's newest turn, resent seconds later, and a single-turn query,
        never reused: the rate would be the queries', and the turns would go first.
        ``single`` blocks go to
        ``evict_first`` and learn their own rate."""
        if ctx.session_id is not None or ctx.app_type is not None or ctx.on_behalf:
            return
        infos = [getattr(node, self.block_attr, None) for node in nodes]
        if any(info is None or info.key_start for info in infos):
            # a block cached without a request (loaded from storage), or a span segment's
            # (each segment's tree is its own): the match does not say where the request goes
            # on from; it stays unguessed (chat)
            return
        # the deepest node matched: HiCache's host-tier part of a match comes after its device
        # part (``hooks._matched_nodes``) and may go deeper
        deepest = max(nodes, key=lambda n: block_offset(n) + len(n.key), default=None)
        branches = getattr(deepest, self.block_attr).branches if deepest is not None else None
        ctx.app_type = "chat" if branches is not None and branches <= 1 else "single"
        ctx.app_inferred = True
        # a request that branched off a shared block: its blocks' rate is also learnt per that
        # block (``_rates``)
        branched = ctx.app_type == "single" and deepest is not None
        ctx.anchor = self.anchor_id(block_key(deepest)) if branched else None
        if ctx.rid is not None:
            self.app_of[ctx.rid] = (ctx.app_type, ctx.anchor)
            if len(self.app_of) > TRACKED_REQUESTS:
                self.app_of.popitem(last=False)

    def anchor_id(self, key: tuple) -> int:
        """The number of the anchor whose ``block_key`` is ``key`` (a new one for a key not
        seen among the last ``tracked_anchor_ids``)."""
        aid = self.anchor_ids.get(key)
        if aid is None:
            aid = self.anchor_ids[key] = next(self._anchor_serial)
            if len(self.anchor_ids) > self.tracked_anchor_ids:
                self.anchor_ids.popitem(last=False)
        else:
            self.anchor_ids.move_to_end(key)
        return aid

    def resolve(self, ctx: RequestContext | None) -> None:
        """A later context of a request whose conversation or application was inferred (the
        server builds one per insert call): give it those."""
        if ctx is not None and ctx.session_id is None and ctx.rid is not None:
            conv = self.conv_of.get(ctx.rid)
            if conv is not None:
                ctx.session_id = conv
        if ctx is not None and ctx.app_type is None and ctx.rid is not None:
            guess = self.app_of.get(ctx.rid)
            if guess is not None:
                ctx.app_type, ctx.anchor = guess
                ctx.app_inferred = True
                self.app_of.move_to_end(ctx.rid)  # a long request keeps its guess
