"""Every environment variable sglang-pic reads, declared once, and the one place that reads them.

Why a registry: SGLang starts its tokenizer, scheduler and detokenizer processes itself, so
values reach them through the environment they inherit. A variable read here and there, by a
name spelled in each place, is configuration nobody can list. Here each one has its name, who
sets it and what it means; ``read`` refuses a name not declared, and a test keeps every other
module of the package from touching ``os.environ`` for reading.

Our server flags' hand-off variables (``SGLANG_PIC_*`` set by the launcher from the flags) are
declared by their own table, ``launcher.server_flags.FLAGS``, which reads them through
``read_declared`` (its ``setting``); the variables below are the rest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    set_by: str
    """Who sets it: the user, SGLang, or our launcher (handing a value to SGLang's processes)."""
    meaning: str


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("SGLANG_USE_CPU_ENGINE", "the user, or sglang-pic on a machine without CUDA",
             "SGLang's CPU engine: '1' runs SGLang on the CPU"),
    Variable("SGLANG_PLUGINS", "the user",
             "SGLang's plugin allowlist (comma-separated; empty: every installed plugin)"),
    Variable("SGLANG_PIC_CACHE", "the user",
             "our cache folder (the converted default model, SGLang's flag names); default "
             "~/.cache/sglang-pic"),
    Variable("SGLANG_PIC_API_KEY", "the user, or our launcher",
             "the server's API key (the launcher hands it to SGLang's process and removes it)"),
    Variable("SGLANG_PIC_ADMIN_API_KEY", "the user, or our launcher",
             "the admin key: admin routes are off without it"),
    Variable("SGLANG_PIC_PTSTORE_TOKEN", "the user, or our launcher",
             "the PTStore token of the store client (a file with --ptstore-token-file)"),
    Variable("SGLANG_PIC_STORE_TOKEN", "the user",
             "the PTStore server's token (`sglang-pic store`; a file with --token-file)"),
    Variable("SGLANG_PIC_ROUTER_ADMIN_KEY", "our fleet launcher",
             "the admin key of the fleet's router (its control plane: workers, tokenizers), "
             "handed to the router's process and removed there"),
    Variable("SGLANG_PIC_SPAN_STORE", "our launcher",
             "the span store tier's PTStore configuration (JSON) for SGLang's scheduler"),
    Variable("SGLANG_PIC_LAUNCHER_PID", "our launcher",
             "the `sglang-pic serve` process the server process reports to"),
    Variable("OMP_NUM_THREADS", "the user",
             "torch's CPU threads; the fleet splits the cores between its instances unless set"),
    Variable("CUDA_VISIBLE_DEVICES", "the user",
             "the GPUs CUDA shows; a fleet sharing one GPU measures the first one's free memory"),
    Variable("TRITON_INTERPRET", "the user, or sglang-pic on a machine without CUDA",
             "Triton's interpreter: '1' runs our kernels on the CPU"),
)}
_DECLARED: dict[str, str] = {}
"""Names declared by another table (``declare``): name -> the table."""


def declare(name: str, table: str) -> None:
    """``name`` is a variable of another table (``table`` says which), readable here."""
    _DECLARED[name] = table


def _known(name: str) -> None:
    if name not in VARIABLES and name not in _DECLARED:
        raise KeyError(f"environment variable {name} is not declared in "
                       "sglang_pic.environment.VARIABLES")


def read(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value (None when unset) from ``environ`` (default: this process's)."""
    _known(name)
    return (os.environ if environ is None else environ).get(name)


def is_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the variable is '1'."""
    return read(name, environ) == "1"


def hand_over(name: str, value: str) -> None:
    """Set the variable for this process and the processes it starts (SGLang's)."""
    _known(name)
    os.environ[name] = value


def take(name: str) -> str | None:
    """The variable's value, removed from this process's environment (a secret or a one-time
    hand-over that must not reach further children)."""
    _known(name)
    return os.environ.pop(name, None)


def default(name: str, value: str) -> None:
    """Set the variable unless it is set."""
    _known(name)
    os.environ.setdefault(name, value)
