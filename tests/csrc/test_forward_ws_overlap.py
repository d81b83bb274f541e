"""The warp-specialised forward runs each block's softmax while its P V product is in flight: in
the SASS of its overlapped kernels every wait for S (WARPGROUP.DEPBAR.LE gsb0, 0x1) is followed by
the block's exponentials before the wait for P V (..., 0x0). ptxas had put that wait above the
softmax in every such kernel (anchor_wait_after in flash_fwd_ws_kernel.h keeps it below). Needs
nvcc, the CUTLASS headers and cuobjdump (conftest.py)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def exponentials_under_pv(sass):
    """For each kernel: the number of MUFU.EX2 between each wait for S and the wait for P V after it."""
    counts = {}
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        name = function.split("\n", 1)[0].strip()
        found, exps = [], None
        for line in function.splitlines():
            if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
                exps = 0
            elif "MUFU.EX2" in line and exps is not None:
                exps += 1
            elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and exps is not None:
                found.append(exps)
                exps = None
        counts[name] = found
    return counts


def test_softmax_runs_under_pv(tmp_path, build_flags, cutlass_include, cuobjdump):
    cubin = tmp_path / "overlap.cubin"
    flags = [f for f in build_flags.kernel_flags(["90"]) if f != "-lineinfo"]
    subprocess.run(["nvcc", *flags, "-cubin", "-I", str(ROOT / "csrc" / "flash_attn" / "src"), "-I", cutlass_include,
                    str(ROOT / "tests" / "csrc" / "forward_ws_overlap.cu"), "-o", str(cubin)],
                   check=True, capture_output=True, text=True)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    counts = exponentials_under_pv(sass)
    assert len(counts) == 2, list(counts)
    for name, found in counts.items():
        # One site per kernel (the turn loop); a block's exponentials: 128 keys over a quad, two rows.
        assert found and all(n >= 64 for n in found), (name, found)
