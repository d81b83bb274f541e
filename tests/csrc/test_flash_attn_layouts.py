"""Compiles tests/csrc/flash_attn_layout_check.cu for the host and runs it: the tiled-MMA layout
facts behind the attention kernels' masks and dropout, and Philox's known answers, without a GPU.
Needs nvcc and the CUTLASS headers (`pip install --no-deps nvidia-cutlass` or CUTLASS_PATH)."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cutlass_include():
    candidates = []
    if os.environ.get("CUTLASS_PATH"):
        candidates += [Path(os.environ["CUTLASS_PATH"]) / "include", Path(os.environ["CUTLASS_PATH"])]
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "source" / "include")
    return next((p for p in candidates if (p / "cute" / "tensor.hpp").is_file()), None)


@pytest.mark.skipif(shutil.which("nvcc") is None or _cutlass_include() is None,
                    reason="needs nvcc and the CUTLASS headers")
def test_kernel_layouts_and_philox(tmp_path):
    binary = tmp_path / "layout_check"
    subprocess.run(["nvcc", "-std=c++17", "-O1", "--expt-relaxed-constexpr", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
                    "-I", str(ROOT / "csrc" / "flash_attn" / "src"), "-I", str(_cutlass_include()),
                    str(ROOT / "tests" / "csrc" / "flash_attn_layout_check.cu"), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout
