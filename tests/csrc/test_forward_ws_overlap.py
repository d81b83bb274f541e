"""The warp-specialised forward runs each block's softmax while its P V product is in flight: in
the SASS of its overlapped kernels every wait for S (WARPGROUP.DEPBAR.LE gsb0, 0x1) is followed by
the block's exponentials before the wait for P V (..., 0x0). ptxas had put that wait above the
softmax in every such kernel (anchor_wait_after in flash_fwd_ws_kernel.h keeps it below). Needs
nvcc, the CUTLASS headers and cuobjdump (the CUDA toolkit's, or the one Triton ships)."""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Loaded from its file: csrc/ on sys.path would make its extension folders (csrc/fused_dense_lib)
# importable as namespace packages and fool the extension checks of other tests.
_spec = importlib.util.spec_from_file_location("build_flags", ROOT / "csrc" / "build_flags.py")
build_flags = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_flags)


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.is_file():
            return str(bundled)
    return None


def _cutlass():
    try:
        return build_flags.cutlass_include_dir()
    except FileNotFoundError:
        return None


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


@pytest.mark.skipif(shutil.which("nvcc") is None or _cutlass() is None or _cuobjdump() is None,
                    reason="needs nvcc, the CUTLASS headers and cuobjdump")
def test_softmax_runs_under_pv(tmp_path):
    cubin = tmp_path / "overlap.cubin"
    flags = [f for f in build_flags.kernel_flags(["90"]) if f != "-lineinfo"]
    subprocess.run(["nvcc", *flags, "-cubin", "-I", str(ROOT / "csrc" / "flash_attn" / "src"), "-I", _cutlass(),
                    str(ROOT / "tests" / "csrc" / "forward_ws_overlap.cu"), "-o", str(cubin)],
                   check=True, capture_output=True, text=True)
    sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    counts = exponentials_under_pv(sass)
    assert len(counts) == 2, list(counts)
    for name, found in counts.items():
        # One site per kernel (the turn loop); a block's exponentials: 128 keys over a quad, two rows.
        assert found and all(n >= 64 for n in found), (name, found)
