"""Instances sharing one GPU get equal shares of it (``sglang_pic.fleet.gpu_share``).

The reference is SGLang's own sizing rule: ``KVCacheConfigurator._profile_available_bytes``,
driven with the GPU memory a sequence of starts would see. Without a GPU, the memory is a
model: each instance loads ``WEIGHTS`` GiB, gets the pool SGLang computes, and holds ``EXTRA``
GiB more (graphs, workspaces) once up.
"""

from __future__ import annotations

import sys
import types

import pytest
from sglang_pic.fleet import config, gpu_share
from sglang_pic.fleet.cli import GPU_MEMORY_SHARE, Fleet
from sglang_pic.launcher.server_flags import UsageError

GIB = 1 << 30
TOTAL = 80.0  # an H100's GiB
WEIGHTS = 16.0  # Llama-3-8B in bfloat16
EXTRA = 2.5


def _sglang_pool_gib(monkeypatch, fraction: float, free_gib: float, weights: float) -> float:
    """The KV pool SGLang gives an instance of ``weights`` GiB started with ``free_gib`` free
    at ``fraction``."""
    from sglang.srt.mem_cache import kv_cache_configurator as kvc

    ns = types.SimpleNamespace
    after_weights = free_gib - weights
    settings = {
        "get_available_gpu_memory": lambda *a, **k: after_weights,
        "get_schedule": lambda: ns(mem_fraction_static=fraction, prefill_max_requests=None,
                                   max_mamba_cache_size=None),
    }
    if hasattr(kvc, "get_world_group"):  # 0.5.17
        settings["get_world_group"] = lambda: ns(world_size=1, cpu_group=None)
    else:  # 0.5.23 reads its settings by group: one GPU, no graphs, no disaggregation
        settings.update(
            get_parallel=lambda: ns(launch_world_size=1, world_group=ns(cpu_group=None)),
            get_exec=lambda: ns(graph=ns(cuda_graph_config=ns(
                prefill=ns(full_prefill_max_req=None, backend=None)))),
            get_disagg=lambda: ns(disaggregation_mode="null"),
            get_mm=lambda: ns(mm_feature_transport=None))
    for name, value in settings.items():
        monkeypatch.setattr(kvc, name, value)
    runner = ns(device="cuda", gpu_id=0, mambaish_config=None, post_capture_kv_active=False,
                model_config=ns(is_multimodal=False))
    return kvc.KVCacheConfigurator._profile_available_bytes(runner, free_gib) / GIB


def _start_one_after_another(monkeypatch, n: int, fraction_for,
                             weights: float = WEIGHTS) -> list[float]:
    """Each instance's pool (GiB) when ``n`` start one after another; ``fraction_for(free)``
    is the ``--mem-fraction-static`` an instance passes when ``free`` GiB are free."""
    free, pools = TOTAL, []
    for _ in range(n):
        pool = _sglang_pool_gib(monkeypatch, fraction_for(free), free, weights)
        pools.append(pool)
        free -= weights + pool + EXTRA
    return pools


def test_the_same_fraction_for_each_leaves_later_instances_little(monkeypatch):
    """What SGLang does with the same fraction for both (measured on an H100: 16.3 and 2.2 GB)."""
    first, second = _start_one_after_another(monkeypatch, 2, lambda free: 0.4)
    assert first == pytest.approx(0.4 * TOTAL - WEIGHTS)
    assert second < first / 4


@pytest.mark.parametrize("n,weights", [(2, WEIGHTS), (3, WEIGHTS), (4, 4.0)])
def test_equal_shares_of_the_whole_gpu_give_equal_pools(monkeypatch, n, weights):
    share = GPU_MEMORY_SHARE / n
    pools = _start_one_after_another(
        monkeypatch, n, lambda free: gpu_share.static_fraction(share, int(free * GIB),
                                                               int(TOTAL * GIB)), weights)
    assert pools == pytest.approx([share * TOTAL - weights] * n, rel=1e-6), pools


def test_a_share_that_no_longer_fits_is_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"0\.400 of the GPU is 32\.0 GiB, and 30\.0 GiB"):
        gpu_share.static_fraction(0.4, 30 * GIB, 80 * GIB)
    for share in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="not between 0 and 1"):
            gpu_share.static_fraction(share, 40 * GIB, 80 * GIB)
    with pytest.raises(ValueError, match="no GPU memory"):
        gpu_share.static_fraction(0.4, 0, 80 * GIB)


def _fake_nvml(monkeypatch, free: int, total: int) -> list[tuple[str, object]]:
    calls: list[tuple[str, object]] = []
    memory = types.SimpleNamespace(free=free, total=total)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append(("init", None)),
        nvmlShutdown=lambda: calls.append(("shutdown", None)),
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(("index", i)) or "h",
        nvmlDeviceGetHandleByUUID=lambda u: calls.append(("uuid", u)) or "h",
        nvmlDeviceGetMemoryInfo=lambda h: memory, NVMLError=RuntimeError)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return calls


@pytest.mark.parametrize("visible,expected", [
    (None, ("index", 0)), ("3,1", ("index", 3)), ("GPU-1a2b,GPU-3c4d", ("uuid", "GPU-1a2b"))])
def test_the_memory_of_the_first_visible_gpu_is_read(monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    calls = _fake_nvml(monkeypatch, 44 * GIB, 80 * GIB)
    assert gpu_share.gpu_memory() == (44 * GIB, 80 * GIB)
    assert calls == [("init", None), expected, ("shutdown", None)]


def test_the_fleet_gives_each_instance_its_share_from_the_memory_free_at_its_start(
        monkeypatch, capsys):
    fleet = Fleet(config.parse(["--instances", "2", "--stores", "0"]))
    assert fleet.instance_gpu_share(on_gpu=False) is None
    fleet.share_of_gpu = fleet.instance_gpu_share(on_gpu=True)
    assert fleet.share_of_gpu == pytest.approx(GPU_MEMORY_SHARE / 2)
    _fake_nvml(monkeypatch, 80 * GIB, 80 * GIB)
    assert fleet.instance_gpu_args(0) == ["--mem-fraction-static", "0.400"]
    _fake_nvml(monkeypatch, 44 * GIB, 80 * GIB)
    assert fleet.instance_gpu_args(1) == ["--mem-fraction-static", "0.727"]
    assert "instance 1: 0.400 of the GPU is --mem-fraction-static 0.727" in capsys.readouterr().out
    _fake_nvml(monkeypatch, 30 * GIB, 80 * GIB)
    with pytest.raises(UsageError, match="instance 1: 0.400 of the GPU is 32.0 GiB"):
        fleet.instance_gpu_args(1)


def test_a_given_share_is_per_instance_and_replaces_the_flag_in_the_command(monkeypatch):
    fleet = Fleet(config.parse(["--instances", "2", "--stores", "0",
                                "--mem-fraction-static", "0.3"]))
    fleet.share_of_gpu = fleet.instance_gpu_share(on_gpu=True)
    assert fleet.share_of_gpu == pytest.approx(0.3)
    _fake_nvml(monkeypatch, 50 * GIB, 80 * GIB)
    cmd = fleet.instance_child(1, fleet.instance_gpu_args(1), {}).cmd
    flags = [i for i, a in enumerate(cmd) if a == "--mem-fraction-static"]
    assert cmd[flags[-1] + 1] == "0.480"  # 0.3 * 80 / 50, after the given 0.3: SGLang takes it


def test_without_nvml_an_instance_gets_the_share_of_what_is_free(monkeypatch, capsys):
    """No NVML (no driver library): the share is passed as it is, with a warning."""
    def no_library():
        raise RuntimeError("NVML Shared Library Not Found")

    _fake_nvml(monkeypatch, 0, 0).clear()
    monkeypatch.setattr(sys.modules["pynvml"], "nvmlInit", no_library)
    with pytest.raises(OSError, match="NVML: NVML Shared Library Not Found"):
        gpu_share.gpu_memory()
    fleet = Fleet(config.parse(["--instances", "2", "--stores", "0"]))
    fleet.share_of_gpu = fleet.instance_gpu_share(on_gpu=True)
    assert fleet.instance_gpu_args(1) == ["--mem-fraction-static", "0.400"]
    assert "WARNING: the GPU's free memory is unknown" in capsys.readouterr().out
