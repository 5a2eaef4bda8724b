"""Requests a ``--sparse-offload`` server cannot hold, refused with HTTP 400 before they run.

With ``--sparse-offload`` a sparse request's retrieval region lives in a host region sized at
start-up: ``--sparse-max-context`` tokens per request (``backends._offload``). A longer request
would not fit it: one that is long already at its first decode step would decode densely from
the GPU pool (the pool offloading is meant to spare), and one that outgrows the region while
decoding would stop moving its window into the region. So a request whose prompt plus
``max_new_tokens`` (SGLang's default, 128, when it names none) is over the region's tokens is
refused before it is scheduled, with the GiB of host KV it needs and what the region holds.

Only a ``--sparse-max-context`` below the model's context length makes such requests possible:
at the context length SGLang's own check (the same function, right after this one) refuses
them. ``check_request_length`` is a BEFORE hook on ``TokenizerManager._validate_one_request``,
which every generation request passes after tokenization (``/generate``, the OpenAI endpoints,
``Engine.generate``; each request of a batch); a ``ValueError`` there is SGLang's HTTP 400 with
the message. The settings are read from the ``SGLANG_PIC_SPARSE_*`` variables at each request,
so SGLang's own launcher (which sets them after the plugin registered) is covered too.
"""

from __future__ import annotations

from sglang_pic import environment
from sglang_pic.security.request_validation import DEFAULT_NEW_TOKENS

from .config import SparseDecodeConfig, host_kv_bytes

_HALF = ("bf16", "bfloat16", "fp16", "float16", "half")


def region_tokens(cfg: SparseDecodeConfig, context_len: int) -> int | None:
    """Tokens of a sparse request's host region when offloading limits requests below the
    model's context length; None when it does not."""
    if not cfg.offload or not cfg.max_context or cfg.max_context >= context_len:
        return None
    return cfg.max_context


def kv_bytes_per_token(model_config, server_args) -> int:
    """Host bytes of one token's K and V over every layer, as the scheduler stores them."""
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto"))
    itemsize = 2 if kv_dtype in _HALF else getattr(model_config.dtype, "itemsize", 2)
    tp = getattr(server_args, "tp_size", 1) or 1
    return host_kv_bytes(
        model_config.num_hidden_layers,
        model_config.get_num_kv_heads(tp) * tp,
        model_config.head_dim,
        itemsize,
        1,
    )


def check_request_length(self, obj, input_ids, *args, **kwargs) -> None:
    """BEFORE hook for ``TokenizerManager._validate_one_request(self, obj, input_ids)``."""
    if not environment.is_on(SparseDecodeConfig.env_name("offload")):
        return
    params = getattr(obj, "sampling_params", None)
    if not isinstance(params, dict):  # embedding requests, or SGLang's own error to come
        return
    limit = region_tokens(SparseDecodeConfig.current(), int(self.context_len))
    if limit is None:
        return
    prompt = len(input_ids) if input_ids is not None else 0
    new = params.get("max_new_tokens")
    new = DEFAULT_NEW_TOKENS if new is None else new
    if not isinstance(new, int) or prompt + new <= limit:
        return  # a bad max_new_tokens is SGLang's to report
    per_token = kv_bytes_per_token(self.model_config, self.server_args)
    raise ValueError(
        f"this request needs {prompt + new} tokens of context ({prompt} prompt + {new} new): "
        f"{per_token * (prompt + new) / 2**30:.2f} GiB of host KV, and with --sparse-offload "
        f"each sparse request's host region holds {limit} tokens "
        f"({per_token * limit / 2**30:.2f} GiB, --sparse-max-context {limit}). Shorten the "
        "prompt or max_new_tokens, or restart the server with a larger --sparse-max-context"
    )
