"""How the CUDA sources are compiled, in one place for setup.py and scripts/prebuild_kernels.py,
and the key that says whether a prebuilt attention unit still matches its sources.

A generated attention unit depends only on its own text, the kernel headers it includes from
csrc/flash_attn/src (followed through their quoted includes), the CUTLASS headers and the nvcc
flags; unit_key hashes exactly those, so an object compiled elsewhere (scripts/prebuild_kernels.py)
is reused by setup.py (FLASH_ATTN_PREBUILT_DIR) only while all of them are unchanged.
"""

import hashlib
import importlib.util
import os
import re
from pathlib import Path

NVCC_FLAGS = [
    "-O3", "-std=c++17", "--use_fast_math", "-lineinfo",
    "--expt-relaxed-constexpr", "--expt-extended-lambda",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    # wgmma N widths past CUTLASS's default set (the wide forward tiles' 176, 112 and 80 keys);
    # without it CuTe silently picks 16-wide instructions for them.
    "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
]


def cutlass_include_dir():
    """The CUTLASS/CuTe include folder: CUTLASS_PATH, else the nvidia-cutlass package's."""
    candidates = []
    if os.getenv("CUTLASS_PATH"):
        base = Path(os.environ["CUTLASS_PATH"])
        candidates += [base / "include", base]
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "source" / "include")
    for path in candidates:
        if (path / "cute" / "tensor.hpp").is_file():
            return str(path)
    raise FileNotFoundError(
        "the CUTLASS/CuTe headers were not found. Install them with `pip install nvidia-cutlass` "
        "or point CUTLASS_PATH at a CUTLASS checkout "
        f"(looked in: {', '.join(map(str, candidates)) or 'nothing'}).")


def gencode_flags(archs):
    flags = []
    for arch in archs:
        # sm_90 is built as sm_90a so that the Hopper-only instructions (wgmma, setmaxnreg) are allowed.
        target = f"{arch}a" if arch == "90" else arch
        flags += ["-gencode", f"arch=compute_{target},code=sm_{target}"]
    return flags


def kernel_flags(archs):
    """nvcc flags of a kernel unit for these compute capabilities (what unit_key hashes)."""
    return NVCC_FLAGS + gencode_flags(archs)


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _local_includes(path, include_dirs, seen):
    for name in _INCLUDE.findall(path.read_text()):
        for base in [path.parent, *include_dirs]:
            candidate = (base / name).resolve()
            if candidate.is_file():
                if candidate not in seen:
                    seen.add(candidate)
                    _local_includes(candidate, include_dirs, seen)
                break
    return seen


def unit_key(unit, kernel_src_dir, cutlass_include_dir, flags):
    """Hash of a generated unit, the kernel headers it reaches, the CUTLASS version and flags."""
    unit, src = Path(unit), Path(kernel_src_dir)
    digest = hashlib.sha256()
    for path in [unit.resolve(), *sorted(_local_includes(unit, [src], set()))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = Path(cutlass_include_dir) / "cutlass" / "version.h"
    digest.update(version.read_bytes() if version.is_file() else b"no cutlass version")
    digest.update(" ".join(flags).encode())
    return digest.hexdigest()


def prebuilt_object(prebuilt_dir, unit, key):
    """The object of `unit` in prebuilt_dir when it was compiled from sources with this unit_key,
    else None."""
    stem = Path(prebuilt_dir) / Path(unit).stem
    obj, key_file = stem.with_suffix(".o"), stem.with_suffix(".key")
    if obj.is_file() and key_file.is_file() and key_file.read_text().strip() == key:
        return obj
    return None
