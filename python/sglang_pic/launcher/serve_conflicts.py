"""Flag combinations sglang-pic cannot serve, refused from the command line alone.

Each feature refuses what it cannot serve when SGLang builds it in the scheduler process
(``position_free.model_check``, ``sparse.backends``, ``spans.radix_cache``): after the model's
weights are loaded, a minute into a start on a small machine, in a traceback that names what the
launcher passed on (``--radix-cache-backend pic_span``, not the user's ``--enable-span-cache``).
What those checks decide from server flags alone is decided here first, in one line naming the
user's flags. What needs the model (architecture, MLA, sliding window, head sizes, an fp8
checkpoint under ``--kv-cache-dtype auto``) stays with the feature's own check.

Standard library only: this runs before SGLang or torch is imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from sglang_pic.compat import gaps, versions
from sglang_pic.compat.versions import installed_sglang
from sglang_pic.launcher.server_flags import FEATURES, FLAGS, UsageError, setting
from sglang_pic.sparse.config import (
    HOST_MEMORY_SHARE,
    SparseDecodeConfig,
    SparseDecodeUnsupported,
    host_kv_bytes,
    host_memory_available,
)

POSITION_FREE_FLAG = "--enable-position-free-kv"
SPAN_FLAG = "--enable-span-cache"
SPAN_BACKEND = "pic_span"  # sglang_pic.spans.config.BACKEND
TWINS = {  # SGLang attention backend -> (position-free twin, sparse twin)
    "flashinfer": ("pic_flashinfer", "pariskv_flashinfer"),
    "triton": ("pic_triton", "pariskv_triton"),
    "torch_native": ("pic_torch_native", "pariskv_torch_native"),
}
# KV cache dtypes both kernels take (keys are rotated/scored in 16 bits or more)
FULL_PRECISION_KV = ("auto", "bf16", "bfloat16")
# SGLang flags that have a second spelling
ALIASES = {
    "--model-path": ("--model",),
    "--tp-size": ("--tensor-parallel-size",),
    "--pp-size": ("--pipeline-parallel-size",),
    "--dcp-size": ("--decode-context-parallel-size",),
}


def value_of(argv: list[str], flag: str) -> str | None:
    """The (last) value of ``flag VALUE`` / ``flag=VALUE`` in ``argv``, under any spelling."""
    found = None
    for name in (flag, *ALIASES.get(flag, ())):
        for i, a in enumerate(argv):
            if a == name and i + 1 < len(argv):
                found = argv[i + 1]
            elif a.startswith(name + "="):
                found = a.split("=", 1)[1]
    return found


def _int(argv: list[str], flag: str, default: int) -> int:
    raw = value_of(argv, flag)
    try:
        return default if raw is None else int(raw)
    except ValueError:
        return default  # SGLang's parser names the bad value


OUR_POLICIES = ("auto", "sae", "gdsf", "s3fifo", "tlru")  # sglang_pic.eviction.POLICIES
EVICTION_POLICIES = (*OUR_POLICIES, "lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
"""``--radix-eviction-policy`` values: ours and SGLang 0.5.17's policy table
(``mem_cache.utils._EVICTION_POLICY_FACTORIES``), all of which the plugin offers; a test checks
this list against the server's choices."""


def _unified_tree_switches() -> dict[str, str]:
    """SGLang's switches that need its unified tree, which the span cache and a cache on one of
    our policies (``eviction.tree``) are not: session radix caching, and streaming sessions on
    the releases that keep them there (``compat.versions``)."""
    flags = ["--enable-session-radix-cache"]
    if versions.streaming_sessions_need_unified_tree(installed_sglang()):
        flags.append("--enable-streaming-session")
    return {flag: "SGLang keeps these sessions in its UnifiedRadixCache's session tree; the span "
                  "cache and our eviction policies run on other trees" for flag in flags}


def refuse(given: Mapping[str, Any], argv: list[str]) -> None:
    """Raise ``UsageError`` for the first combination of our flags (``given``: parsed, only
    those on the command line) and SGLang's (``argv``) that cannot be served."""
    policy = value_of(argv, "--radix-eviction-policy")
    if policy is not None and policy not in EVICTION_POLICIES:
        raise UsageError(f"--radix-eviction-policy: {policy!r} is not a policy (choose from "
                         f"{', '.join(EVICTION_POLICIES)})")
    if "--ptstore-token" in given:
        raise UsageError("--ptstore-token would put the token on the command line, which every "
                         "user of the machine sees (ps): use --ptstore-token-file PATH or "
                         "$SGLANG_PIC_PTSTORE_TOKEN")
    on = _features_on(given, argv)
    _knobs_need_their_feature(given, on)
    _not_on_this_release(given, argv, on)
    if on["position_free"]:
        _position_free(given, argv)
    if on["spans"]:
        _spans(given, argv)
    if on["sparse"]:
        _sparse(given, argv)
    if on["eviction"]:
        _not_with(_asked_by("eviction", given, argv), argv, switches=_unified_tree_switches())


def _features_on(given: Mapping[str, Any], argv: list[str]) -> dict[str, bool]:
    spans = SPAN_FLAG in given or value_of(argv, "--radix-cache-backend") == SPAN_BACKEND
    chosen = value_of(argv, "--attention-backend") or ""
    ours = value_of(argv, "--radix-eviction-policy") in OUR_POLICIES
    return {
        "spans": spans,
        "position_free": spans or POSITION_FREE_FLAG in given or chosen.startswith("pic_"),
        "ptstore": "--ptstore" in given,
        "hicache_storage": "--ptstore" in given or bool(value_of(argv, "--hicache-storage-backend")),
        "sparse": "--sparse-decode" in given,
        "sae": value_of(argv, "--radix-eviction-policy") == "sae",
        "tlru": value_of(argv, "--radix-eviction-policy") == "tlru",
        "eviction": ours,
        "eviction_with_hicache": ours and bool(_hicache_flag(given, argv)),
    }


def _asked_by(capability: str, given: Mapping[str, Any], argv: list[str]) -> str:
    """The flags that ask for ``capability``, as the user gave them (for a refusal)."""
    if capability == "spans":
        return SPAN_FLAG if SPAN_FLAG in given else f"--radix-cache-backend {SPAN_BACKEND}"
    if capability.startswith("eviction"):
        policy = f"--radix-eviction-policy {value_of(argv, '--radix-eviction-policy')}"
        return policy if capability == "eviction" else f"{policy} with {_hicache_flag(given, argv)}"
    return f"--{capability.replace('_', '-')}"


def _hicache_flag(given: Mapping[str, Any], argv: list[str]) -> str | None:
    """The flag that puts HiCache's host tier under the prefix cache, if any (``--ptstore``
    turns it on)."""
    if "--enable-hierarchical-cache" in argv:
        return "--enable-hierarchical-cache"
    return "--ptstore" if "--ptstore" in given else None


def _not_on_this_release(given: Mapping[str, Any], argv: list[str],
                         on: Mapping[str, bool]) -> None:
    """Refuse a capability the installed SGLang release has a gap for (``compat.gaps``)."""
    for found in gaps.gaps_for(installed_sglang()):
        if on.get(found.capability):
            raise UsageError(found.message(_asked_by(found.capability, given, argv)))


def _knobs_need_their_feature(given: Mapping[str, Any], on: dict[str, bool]) -> None:
    for feature, is_on in on.items():
        knobs = [name for name in given if FLAGS[name].feature == feature]
        if knobs and not is_on:
            what = FEATURES[feature]
            raise UsageError(f"{', '.join(knobs)}: {what.title} flags need {what.switch}")


def _not_with(ours: str, argv: list[str], switches: Mapping[str, str] = {},
              values: Mapping[str, Callable[[str], str | None]] = {}) -> None:
    """Refuse the first of SGLang's ``switches`` (``{flag: reason}``) present in ``argv``, or of
    its ``values`` (``{flag: check}``) whose check of the given value returns a reason."""
    for flag, reason in switches.items():
        if flag in argv:
            raise UsageError(f"{ours} does not combine with {flag} ({reason})")
    for flag, check in values.items():
        value = value_of(argv, flag)
        reason = None if value is None else check(value)
        if reason is not None:
            raise UsageError(f"{ours} does not combine with {flag} {value} ({reason})")


def _shared_refusals(twin: Callable[[str], bool],
                     phases: str) -> dict[str, Callable[[str], str | None]]:
    """The SGLang values position-free KV and sparse decoding both refuse: their kernels replace
    SGLang's attention in both phases, over 16-bit keys, on one decode rank."""
    def other_backend(value: str) -> str | None:
        return None if twin(value) else phases

    return {
        "--prefill-attention-backend": other_backend,
        "--decode-attention-backend": other_backend,
        "--speculative-algorithm": lambda _v: "speculative decoding is not supported",
        "--dcp-size": lambda v: None if v.strip() == "1" else "decode context parallelism",
        "--kv-cache-dtype": lambda v: None if v in FULL_PRECISION_KV else
        "the kernels read 16-bit keys: use auto or bf16",
    }


def _attention_backend(ours: str, argv: list[str], slot: int) -> None:
    chosen = value_of(argv, "--attention-backend")
    twins = {name: pair[slot] for name, pair in TWINS.items()}
    if chosen is not None and chosen not in twins and chosen not in twins.values():
        raise UsageError(f"{ours} needs --attention-backend {' or '.join(twins)} "
                         f"(got {chosen!r})")


def _position_free(given: Mapping[str, Any], argv: list[str]) -> None:
    ours = SPAN_FLAG if SPAN_FLAG in given else POSITION_FREE_FLAG
    if "--sparse-decode" in given:
        raise UsageError(f"--sparse-decode does not combine with {ours} (position-free KV) yet")
    if SPAN_FLAG in given or POSITION_FREE_FLAG in given:
        _attention_backend(ours, argv, 0)
    _not_with(ours, argv, switches={
        "--enable-deterministic-inference": "not supported by the position-free kernels",
        "--enable-multimodal": "multimodal models use M-RoPE",
    }, values=_shared_refusals(lambda v: v.startswith("pic_"),
                               "both phases must run the position-free kernels"))


def _spans(given: Mapping[str, Any], argv: list[str]) -> None:
    ours = SPAN_FLAG if SPAN_FLAG in given else f"--radix-cache-backend {SPAN_BACKEND}"
    backend = value_of(argv, "--radix-cache-backend")
    if SPAN_FLAG in given and backend not in (None, SPAN_BACKEND):
        raise UsageError(f"{SPAN_FLAG} is --radix-cache-backend {SPAN_BACKEND}: drop "
                         f"--radix-cache-backend {backend}")
    _not_with(ours, argv, switches={
        "--disable-radix-cache": "spans are found and shared in the radix tree",
        "--enable-hierarchical-cache": "HiCache does not take span pages yet; --ptstore stores "
                                       "them instead",
        **_unified_tree_switches(),
    }, values={"--disaggregation-mode": lambda v: None if v == "null" else (
        "KV a prefill instance sends arrives without the positions its keys were computed at, "
        "which span requests need")})
    if "--ptstore" in given:
        tp, pp = _int(argv, "--tp-size", 1), _int(argv, "--pp-size", 1)
        if tp > 1 or pp > 1:
            raise UsageError(f"--ptstore with {SPAN_FLAG} needs --tp-size 1 and --pp-size 1 "
                             f"(got {tp} and {pp}): each rank would decide alone whether a span "
                             "loads")
        if "--ptstore-trace" in given:
            raise UsageError(f"--ptstore-trace traces HiCache's PTStore tier, which {SPAN_FLAG} "
                             "does not use")


def _sparse(given: Mapping[str, Any], argv: list[str]) -> None:
    ours = "--sparse-decode pariskv"
    _attention_backend(ours, argv, 1)
    values = _shared_refusals(lambda v: v.startswith("pariskv_"),
                              "both phases must use the sparse twin backend")
    values["--disaggregation-mode"] = lambda v: None if v == "null" else (
        "a decode instance runs no prefill, so a sparse slot never learns its request changed")
    _not_with(ours, argv, switches=dict.fromkeys(
        ("--enable-dp-attention", "--enable-two-batch-overlap", "--enable-pdmux"),
        "not supported with sparse decoding"), values=values)

    cfg = sparse_config(given)
    context = value_of(argv, "--context-length")
    if context is not None and context.isdigit() and int(context) <= cfg.threshold:
        raise UsageError(f"{ours} with --context-length {context} <= --sparse-threshold "
                         f"{cfg.threshold}: nothing would ever decode sparsely")
    refuse_for_model(given, argv)
    if "--sparse-offload" in given:
        _not_with("--sparse-offload", argv, switches={
            "--enable-mixed-chunk": "a decode token run in a prefill batch attends densely, "
                                    "over slots offloading has freed",
        }, values={
            "--page-size": lambda v: None if v.strip() == "1" else
            "slots are freed one token at a time",
        })


def sparse_config(given: Mapping[str, Any]) -> SparseDecodeConfig:
    """The sparse settings the schedulers will read (flags over inherited variables over
    defaults), checked across knobs."""
    values = {}
    for field in SparseDecodeConfig.__dataclass_fields__:
        name = SparseDecodeConfig.flag(field)
        if name in FLAGS:
            values[field] = given[name] if name in given else setting(name)
    values["offload"] = int(bool(values["offload"]))
    cfg = SparseDecodeConfig(**values)
    try:
        cfg.validate()
    except SparseDecodeUnsupported as e:
        raise UsageError(str(e)) from None
    return cfg


# SGLang's order of the config keys that give a model's context length
# (``sglang.srt.utils.hf_transformers.common.CONTEXT_LENGTH_KEYS``)
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


def model_config(model_path: str | None) -> dict | None:
    """The text config of a local checkpoint folder (``config.json``), or None (a hub name, a
    GGUF file, no config: the scheduler's own checks decide after loading the model)."""
    if not model_path:
        return None
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def context_length(config: Mapping[str, Any]) -> int | None:
    """The context length SGLang derives from ``config`` (``get_context_length``: the first of
    ``CONTEXT_LENGTH_KEYS``, times the RoPE scaling factor unless the scaling is llama3's or
    names the original length)."""
    scaling = config.get("rope_scaling") or {}
    factor = 1
    if isinstance(scaling, dict) and "original_max_position_embeddings" not in scaling \
            and scaling.get("rope_type") != "llama3":
        factor = scaling.get("factor", 1) or 1
    for key in CONTEXT_LENGTH_KEYS:
        value = config.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return int(factor * value)
    return None


def refuse_for_model(given: Mapping[str, Any], argv: list[str]) -> None:
    """What sparse decoding refuses from the model's own ``config.json`` (``--model-path`` a
    local folder), before SGLang loads the weights: a ``--sparse-threshold`` the model's context
    never exceeds, and a ``--sparse-offload`` host region larger than the host memory left."""
    if "--sparse-decode" not in given:
        return
    config = model_config(value_of(argv, "--model-path"))
    if config is None:
        return
    cfg = sparse_config(given)
    given_context = value_of(argv, "--context-length")
    if given_context is not None and given_context.isdigit():
        context, where = int(given_context), "--context-length"
    else:
        context, where = context_length(config), "the model's config.json"
        if context is not None and context <= cfg.threshold:
            raise UsageError(
                f"--sparse-decode pariskv with --sparse-threshold {cfg.threshold}: the model's "
                f"context length is {context} tokens ({where}), so no request would ever "
                "decode sparsely; lower --sparse-threshold below it")
    if "--sparse-offload" in given and context is not None:
        _host_region_fits(cfg, config, context, argv)


def _host_region_fits(cfg: SparseDecodeConfig, config: Mapping[str, Any], context: int,
                      argv: list[str]) -> None:
    """Refuse a ``--sparse-offload`` region the host cannot hold. A lower bound of what the
    scheduler allocates (16-bit KV unless ``--dtype float32``): it refuses the rest with the
    exact numbers once the model is loaded."""
    heads = config.get("num_attention_heads")
    layers = config.get("num_hidden_layers")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    if not all(isinstance(x, int) and x > 0 for x in (layers, kv_heads, head_dim)):
        return
    full = value_of(argv, "--kv-cache-dtype") in (None, "auto") \
        and value_of(argv, "--dtype") in ("float32", "float")
    itemsize = 4 if full else 2
    max_context = min(cfg.max_context or context, context)
    tokens = cfg.max_requests * max(0, max_context - cfg.sink - cfg.local)
    need = host_kv_bytes(layers, kv_heads, head_dim, itemsize, tokens)
    available = host_memory_available()
    if need > HOST_MEMORY_SHARE * available:
        raise UsageError(
            f"--sparse-offload: {cfg.max_requests} sparse requests of up to {max_context} tokens "
            f"need {need / 2**30:.1f} GiB of host memory for their KV ({layers} layers x "
            f"{kv_heads} KV heads x {head_dim} x {itemsize} bytes, K and V, per token) and "
            f"{available / 2**30:.1f} GiB are available: lower --sparse-max-requests or "
            "--sparse-max-context")
