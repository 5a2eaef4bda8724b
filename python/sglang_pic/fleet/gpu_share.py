"""Equal shares of one GPU for the instances of a fleet that share it.

SGLang sizes an instance's static memory (its weights and KV pool) from the GPU memory that is
free when the instance starts, not from the whole GPU: the pool gets what is free after the
weights load, less ``(1 - mem_fraction_static)`` of what was free before it
(``KVCacheConfigurator._profile_available_bytes``). So the weights and pool together come to
``mem_fraction_static * free_at_start``. Started one after another with the same fraction, each
instance gets a fraction of what its neighbours left. Two instances at 0.4 of an 80 GB GPU with
16 GB of weights each: the first's pool is 0.4 x 80 - 16 = 16 GB; the second starts with about
44 GB free and gets 0.4 x 44 - 16, under 2 GB.

For ``share`` of the whole GPU, an instance that starts when ``free`` bytes of ``total`` are free
passes ``share * total / free``. The launcher reads the free memory through NVML (``pynvml``,
installed with SGLang) just before each start; NVML makes no CUDA context in the launcher.
"""

from __future__ import annotations

from sglang_pic import environment

MAX_STATIC_FRACTION = 0.95
"""The most of the free memory one instance's weights and pool may take: the rest is its
activations, CUDA graphs and workspaces (SGLang's own default leaves about 0.1 of the GPU)."""


def static_fraction(share: float, free_bytes: int, total_bytes: int) -> float:
    """The ``--mem-fraction-static`` that gives an instance starting with ``free_bytes`` free
    ``share`` of the GPU's ``total_bytes`` for its weights and KV pool. ``ValueError`` (the
    sizes in GiB) when that share does not fit in what is free."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"a GPU share of {share} is not between 0 and 1")
    if free_bytes <= 0 or total_bytes <= 0:
        raise ValueError(f"no GPU memory to share ({free_bytes} of {total_bytes} bytes free)")
    fraction = share * total_bytes / free_bytes
    if fraction > MAX_STATIC_FRACTION:
        gib = 1 << 30
        raise ValueError(f"{share:.3f} of the GPU is {share * total_bytes / gib:.1f} GiB, and "
                         f"{free_bytes / gib:.1f} GiB of its {total_bytes / gib:.1f} GiB are "
                         f"free (an instance needs room beyond its share): use fewer "
                         f"instances or a smaller --mem-fraction-static")
    return fraction


def first_visible_gpu() -> str:
    """The GPU the instances use (the first of ``CUDA_VISIBLE_DEVICES``, else index 0): an
    index or a UUID, as CUDA takes it."""
    visible = environment.read("CUDA_VISIBLE_DEVICES") or "0"
    return visible.split(",")[0].strip()


def gpu_memory(gpu: str | None = None) -> tuple[int, int]:
    """``(free, total)`` bytes of ``gpu`` (an index or a UUID; default the first visible one),
    from NVML. ``OSError`` when NVML cannot tell (no library, no such GPU)."""
    gpu = first_visible_gpu() if gpu is None else gpu
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # ImportError, or pynvml.NVMLError: no driver library
        raise OSError(f"NVML: {e}") from None
    try:
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(gpu)) if gpu.isdigit()
                  else pynvml.nvmlDeviceGetHandleByUUID(gpu))
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)
    except pynvml.NVMLError as e:
        raise OSError(f"NVML, GPU {gpu}: {e}") from None
    finally:
        pynvml.nvmlShutdown()
