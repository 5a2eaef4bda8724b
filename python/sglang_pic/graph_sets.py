"""One hook per decode-graph-runner method for every CUDA graph set we capture beside SGLang's.

Two features capture a second set of decode graphs under a variant label of their own: span
decode steps (``position_free.span_graphs``, with ``--position-free-span-graphs``) and sparse
decoding (``sparse.graphs``). Each wraps ``DecodeCudaGraphRunner._capture_one_stream`` (to capture
again) and ``_make_graph_key`` (to label the set). Two AROUND hooks of one plugin on one target
make SGLang warn at every start, so the seam table names these composers instead: the span
wrapper around the sparse one. Each wrapper passes straight through when the runner's backend
is not its feature's, and a server runs at most one of the two (position-free KV and sparse
decoding do not combine: ``launcher.serve_conflicts``).
"""

from __future__ import annotations

import functools
from typing import Any

from sglang_pic.position_free import span_graphs
from sglang_pic.sparse import graphs as sparse_graphs


def around_capture_one_stream(original, self, *args: Any, **kwargs: Any):
    inner = functools.partial(sparse_graphs.around_capture_one_stream, original)
    return span_graphs.around_capture_one_stream(inner, self, *args, **kwargs)


def around_make_graph_key(original, self, size, stream_idx=None, variant_label=None):
    inner = functools.partial(sparse_graphs.around_make_graph_key, original)
    return span_graphs.around_make_graph_key(inner, self, size, stream_idx, variant_label)
