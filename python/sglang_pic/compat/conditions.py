"""The conditions a seam row may carry: when the plugin registers and checks that row.

Each reads what its feature reads, in this process, when the plugin registers: our flags'
handed-over variables through ``server_flags.setting`` (parsed as the flag is), and the CPU
engine's selection. A row without a condition is always registered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang_pic import environment


@dataclass(frozen=True)
class Condition:
    """A predicate over this process's configuration, and what it means in the docs."""

    test: Callable[[], bool]
    text: str


def _setting(flag: str) -> Callable[[], bool]:
    def test() -> bool:
        from sglang_pic.launcher.server_flags import setting

        return bool(setting(flag))

    return test


def cpu_engine() -> bool:
    """SGLang's CPU engine: asked for (``SGLANG_USE_CPU_ENGINE=1``), or nothing asked and no
    CUDA device. The plugin selects the engine by this too, before the rows are read; it sets
    the variable, so the answer does not change afterwards."""
    engine = environment.read("SGLANG_USE_CPU_ENGINE")
    if engine is not None:
        return engine == "1"
    from sglang_pic.cpu.support import has_cuda

    return not has_cuda()


def _sparse_offload() -> bool:
    # the --sparse-offload hand-off (the launcher sets it before plugins load)
    from sglang_pic.launcher.server_flags import setting

    return bool(setting("--sparse-offload"))


CONDITIONS: dict[str, Condition] = {
    "cpu": Condition(cpu_engine, "SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, or unset on a "
                                 "machine without CUDA)"),
    "sae_stats": Condition(_setting("--sae-stats"), "`--sae-stats FILE` (measurement)"),
    "sparse_offload": Condition(_sparse_offload,
                                "`--sparse-offload` (`SGLANG_PIC_SPARSE_OFFLOAD=1`)"),
    "storage_idle_yield": Condition(_setting("--hicache-storage-idle-yield-us"),
                                    "`--hicache-storage-idle-yield-us` is not 0 (default 100)"),
    "ptstore_trace": Condition(_setting("--ptstore-trace"), "`--ptstore-trace`"),
}
"""Every condition a row may name."""


def holds(name: str) -> bool:
    """Whether condition ``name`` holds in this process now."""
    return CONDITIONS[name].test()
