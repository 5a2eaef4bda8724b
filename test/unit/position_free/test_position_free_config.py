"""What position-free KV refuses at start, and how the CLI maps the flag to a backend."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch
from sglang_pic.launcher.launch_server import _with_position_free_backend
from sglang_pic.position_free.model_check import (
    PositionFreeUnsupported,
    check_server_settings,
)


def _runner(**over):
    from sglang.srt.configs.model_config import AttentionArch

    config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
        attention_arch=AttentionArch.MHA, is_multimodal=False,
    )
    args = SimpleNamespace(speculative_algorithm=None, enable_deterministic_inference=False,
                           dcp_size=1, prefill_attention_backend=None,
                           decode_attention_backend=None)
    runner = SimpleNamespace(model_config=config, server_args=args,
                             kv_cache_dtype=torch.bfloat16, sliding_window_size=None)
    for key, value in over.items():
        target = config if key in ("attention_arch", "is_multimodal", "hf_config") else (
            args if hasattr(args, key) else runner)
        setattr(target, key, value)
    return runner


def test_supported_settings_pass():
    check_server_settings(_runner())


@pytest.mark.parametrize("override, words", [
    ({"kv_cache_dtype": torch.float8_e4m3fn}, "KV cache dtype"),
    ({"speculative_algorithm": "EAGLE"}, "speculative decoding"),
    ({"sliding_window_size": 4096}, "sliding-window"),
    ({"enable_deterministic_inference": True}, "deterministic"),
    ({"hf_config": SimpleNamespace(architectures=["DeepseekV3ForCausalLM"])}, "architecture"),
    ({"is_multimodal": True}, "multimodal"),
    ({"decode_attention_backend": "flashinfer"}, "both phases must be position-free"),
])
def test_unsupported_settings_are_refused_with_reason(override, words):
    with pytest.raises(PositionFreeUnsupported, match=words):
        check_server_settings(_runner(**override))


def test_mla_is_refused():
    from sglang.srt.configs.model_config import AttentionArch

    with pytest.raises(PositionFreeUnsupported, match="MLA"):
        check_server_settings(_runner(attention_arch=AttentionArch.MLA))


@pytest.mark.parametrize("argv, backend", [
    ([], "pic_flashinfer"),
    (["--attention-backend", "flashinfer"], "pic_flashinfer"),
    (["--attention-backend", "triton"], "pic_triton"),
    (["--attention-backend=torch_native"], "pic_torch_native"),
    (["--attention-backend", "pic_torch_native"], "pic_torch_native"),
])
def test_flag_selects_position_free_twin(argv, backend):
    out = _with_position_free_backend(argv)
    joined = " ".join(out)
    assert backend in joined and joined.count("attention-backend") == 1


def test_flag_with_other_backend_exits_with_message():
    r = subprocess.run(
        [sys.executable, "-m", "sglang_pic", "serve", "--model-path", tempfile.gettempdir(),
         "--enable-position-free-kv", "--attention-backend", "fa3"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode != 0
    assert "needs --attention-backend flashinfer or triton or torch_native" in r.stderr
