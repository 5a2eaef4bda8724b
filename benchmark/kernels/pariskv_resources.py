"""Registers, spills and shared memory of each ParisKV kernel on the H200 (sm_90), on any machine.

Compiles every launch of ``sglang_pic_kernel.pariskv.hopper_build.LAUNCHES`` (the server's
argument types and constants) for sm_90 with Triton's compiler, at each ``--warps``, and reads
``ptxas -v``: registers per thread (above 128 a warp scheduler holds fewer than 4 warps of it;
at batch 1 the grids are small, so this matters less than each program's chain of dependent
loads and reductions), bytes spilled to local memory (slow: a number to keep at 0) and shared
memory. No GPU needed, so it runs where the device is not.

    python3 -m benchmark.kernels.pariskv_resources [--warps 4 8] [--out DIR]

Prints a table; writes ``pariskv_resources_sm90.json`` (machine, versions, per kernel and warp
count) into ``--out`` (default ``benchmark/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmark import description

os.environ["TRITON_INTERPRET"] = "0"  # the compiler's kernels, not the interpreter's
REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8],
                    help="num_warps to build each kernel with (the server's launches use 4; "
                         "the encode 8, top-k more for more than 4096 candidates)")
    ap.add_argument("--out", default=str(REPO / "benchmark" / "results"))
    args = ap.parse_args()
    if any(w not in (1, 2, 4, 8, 16, 32) for w in args.warps):
        ap.error("--warps: powers of two from 1 to 32")
    import triton
    from sglang_pic_kernel.pariskv.hopper_build import (
        LAUNCHES,
        compile_for_hopper,
        ptxas_resources,
    )

    from benchmark.harness import environment

    rows = []
    print(f"{'kernel':28} {'warps':>5} {'registers':>9} {'spilled B':>9} {'shared B':>8}")
    for name in LAUNCHES:
        for warps in args.warps:
            t = time.perf_counter()
            res = ptxas_resources(compile_for_hopper(name, num_warps=warps))
            res.update(kernel=name, build_s=round(time.perf_counter() - t, 2))
            rows.append(res)
            spilled = res["spill_stores_bytes"] + res["spill_loads_bytes"]
            print(f"{name:28} {warps:>5} {res['registers']:>9} {spilled:>9} "
                  f"{res['shared_bytes']:>8}", flush=True)
    out = Path(args.out) / "pariskv_resources_sm90.json"
    out.write_text(json.dumps({"benchmark": "pariskv_resources", "target": "cuda sm_90",
                               "triton": triton.__version__, "environment": environment(),
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
