"""CPU support: stand-ins act only when the real package is missing; CPU defaults respect users."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from sglang_pic.cpu import support as cpu_support


def _run(code: str, extra_path: str | None = None) -> str:
    env_code = f"import sys; sys.path.insert(0, {extra_path!r})\n" if extra_path else ""
    out = subprocess.run([sys.executable, "-c", env_code + textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_stand_ins_serve_missing_packages():
    out = _run("""
        import sglang_pic.cpu.support as c; c.install_import_stand_ins()
        import torchvision, sgl_kernel
        from torchvision.io import ImageReadMode
        print(c.is_stand_in(torchvision), c.is_stand_in(sgl_kernel))
        try:
            sgl_kernel.fused_add_rmsnorm(1)
        except NotImplementedError as e:
            print("raised", "fused_add_rmsnorm" in str(e))
        try:
            import sgl_kernel.scalar_type
        except ImportError:
            print("no submodules")
    """)
    assert out.splitlines() == ["True True", "raised True", "no submodules"]


def test_real_package_wins_over_stand_in(tmp_path):
    pkg = tmp_path / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    out = _run("""
        import sglang_pic.cpu.support as c; c.install_import_stand_ins()
        import torchvision
        print(getattr(torchvision, "REAL", False), c.is_stand_in(torchvision))
    """, extra_path=str(tmp_path))
    assert out == "True False"


def test_pth_line_installs_finder(tmp_path):
    path = cpu_support.write_pth(str(tmp_path))
    out = _run(f"""
        import site; site.addsitedir({str(tmp_path)!r})
        import sys, sglang_pic.cpu.support as c
        print(sum(isinstance(f, c._StandInFinder) for f in sys.meta_path))
    """)
    assert out == "1"
    assert path.endswith(cpu_support.PTH_NAME)


def test_cpu_defaults_fill_only_missing_flags(model_dir):
    extra = cpu_support.cpu_server_defaults(["--model-path", str(model_dir)], str(model_dir))
    assert extra[extra.index("--device") + 1] == "cpu"
    assert extra[extra.index("--attention-backend") + 1] == "torch_native"
    budget = int(extra[extra.index("--max-total-tokens") + 1])
    assert 1024 <= budget <= 65536
    assert "--sleep-on-idle" in extra
    assert extra[extra.index("--dtype") + 1] == "float32"  # the embedded checkpoint's dtype
    assert "--dtype" not in cpu_support.cpu_server_defaults(["--dtype", "bfloat16"], str(model_dir))
    assert "--sleep-on-idle" not in cpu_support.cpu_server_defaults(
        ["--sleep-on-idle"], str(model_dir))
    user = ["--attention-backend", "triton", "--max-total-tokens=4096", "--device", "cpu"]
    extra = cpu_support.cpu_server_defaults(user, str(model_dir))
    assert "--attention-backend" not in extra
    assert "--max-total-tokens" not in extra
    assert "--device" not in extra


def test_transfer_kv_direct_copies_rows():
    torch = pytest.importorskip("torch")
    src = [torch.arange(20.0).reshape(10, 2), torch.arange(20.0, 40.0).reshape(10, 2)]
    dst = [torch.zeros(6, 2), torch.zeros(6, 2)]
    cpu_support.transfer_kv_direct(src, dst, torch.tensor([7, 2]), torch.tensor([0, 5]), page_size=1)
    assert dst[0][0].tolist() == [14.0, 15.0] and dst[0][5].tolist() == [4.0, 5.0]
    assert dst[1][0].tolist() == [34.0, 35.0]
    assert dst[0][1:5].abs().sum() == 0


@pytest.mark.kernels
def test_alloc_decode_torch_matches_sglang_triton_kernel():
    """Our torch decode allocator vs SGLang's Triton kernel run by the interpreter."""
    out = _run("""
        import os; os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from sglang.kernels.ops.memory.allocator import alloc_decode_kernel
        from sglang_pic.cpu.support import alloc_decode_torch
        ps = 4
        seq_lens = torch.tensor([5, 7, 9, 13, 2], dtype=torch.int64)   # 5, 9, 13 start new pages
        last_loc = torch.tensor([43, 21, 63, 95, 100], dtype=torch.int64)
        free_pages = torch.tensor([30, 31, 40, 41], dtype=torch.int64)
        ref = torch.empty(5, dtype=torch.int64); ours = torch.empty(5, dtype=torch.int64)
        alloc_decode_kernel[(5,)](seq_lens, last_loc, free_pages, ref, 8, ps)
        alloc_decode_torch(seq_lens, last_loc, free_pages, ours, 8, ps)
        print(ref.tolist() == ours.tolist(), ours.tolist())
    """)
    assert out == "True [120, 22, 124, 160, 101]"
