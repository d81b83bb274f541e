"""Standalone build of fused_dense_lib, as in flash-attn: `cd csrc/fused_dense_lib && pip install
--no-build-isolation .` (the root setup.py builds the same sources with the rest of the package).

FLASH_ATTN_CUDA_ARCHS="80;90" picks the architectures (default: the visible GPU's, else 80;90).
"""

import os
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

HERE = Path(__file__).resolve().parent


def cublas_dirs():
    """Headers and libraries of the nvidia-cublas wheel, where the CUDA toolkit lacks them."""
    include_dirs, library_dirs = [], []
    for entry in sys.path:
        for sub in ("nvidia/cublas", "nvidia/cu13", "nvidia/cu12"):
            base = Path(entry) / sub
            if (base / "include" / "cublasLt.h").is_file():
                include_dirs.append(str(base / "include"))
                if (base / "lib").is_dir():
                    library_dirs.append(str(base / "lib"))
    return include_dirs, library_dirs


def gencode_flags():
    archs = [a for a in os.getenv("FLASH_ATTN_CUDA_ARCHS", "").replace(",", ";").split(";") if a.strip()]
    if not archs:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            archs = [f"{major}{minor}"]
        else:
            archs = ["80", "90"]
    flags = []
    for arch in archs:
        target = f"{arch}a" if arch == "90" else arch
        flags += ["-gencode", f"arch=compute_{target},code=sm_{target}"]
    return flags


include_dirs, library_dirs = cublas_dirs()
setup(
    name="fused_dense_lib",
    ext_modules=[
        CUDAExtension(
            name="fused_dense_lib",
            sources=["fused_dense.cpp", "fused_dense_cuda.cu"],
            include_dirs=[str(HERE)] + include_dirs,
            library_dirs=library_dirs,
            libraries=["cublasLt", "cublas"],
            extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                                "nvcc": ["-O3", "-std=c++17"] + gencode_flags()},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
