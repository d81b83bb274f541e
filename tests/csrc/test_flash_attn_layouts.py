"""Compiles tests/csrc/flash_attn_layout_check.cu for the host and runs it: the tiled-MMA layout
facts behind the attention kernels' masks and dropout, and Philox's known answers, without a GPU.
Needs nvcc and the CUTLASS headers (conftest.py)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_layouts_and_philox(tmp_path, cutlass_include):
    binary = tmp_path / "layout_check"
    subprocess.run(["nvcc", "-std=c++17", "-O1", "--expt-relaxed-constexpr", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
                    "-I", str(ROOT / "csrc" / "flash_attn" / "src"), "-I", cutlass_include,
                    str(ROOT / "tests" / "csrc" / "flash_attn_layout_check.cu"), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout
