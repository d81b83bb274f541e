"""Build of flash_attn: the Python package and its CUDA extensions.

`pip install --no-build-isolation .` compiles every extension whose sources are present when a
CUDA build of PyTorch and nvcc are available, and installs the Python package alone otherwise.

Environment knobs (all optional):
  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE  install the Python package alone
  FLASH_ATTN_CUDA_ARCHS="80;90"         compute capabilities (default: the visible GPU's, else 80;90)
  FLASH_ATTN_HDIMS="64,128"             attention head dims to build, or "all" (default: 64,128,192,256
                                        for sm_90 alone, else all; see generate_kernels.py); a head dim that
                                        was not built runs on the next larger one that was
  FLASH_ATTN_DTYPES="bf16"              attention dtypes to build (default: fp16,bf16)
  FLASH_ATTN_EXTENSIONS="fused_dense_lib,dropout_layer_norm"  extensions to build (default: all)
  MAX_JOBS, NVCC_THREADS                parallel compile jobs (ninja) and nvcc threads per job
  CUTLASS_PATH                          CUTLASS checkout or include dir (default: nvidia-cutlass)
  FLASH_ATTN_PREBUILT_DIR               objects of attention units compiled by
                                        scripts/prebuild_kernels.py; each is linked instead of
                                        compiled while its sources and flags are unchanged
  CXX                                   host compiler, used when csrc/host_compiler.py accepts it
                                        (a GCC of PyTorch's major version whose extensions use
                                        PyTorch's shared libstdc++ and pass its exception probe);
                                        else such a GCC is looked for on PATH, and the build
                                        stops if none is found
  FLASH_ATTN_ANY_HOST_COMPILER=1        build with CXX (or c++) unchecked

The extensions build side by side, each with its own ninja file, so that the small ones compile
while the attention units do.
"""

import copy
import glob
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
PACKAGE_NAME = "flash_attn"


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_flags = load_module("build_flags", "csrc/build_flags.py")  # nvcc flags, prebuilt-unit keys
host_compiler = load_module("host_compiler", "csrc/host_compiler.py")  # the GCC to build with

# One row per native extension: its source folder and what it links against.
EXTENSIONS = {
    "flash_attn_2_cuda": dict(folder="csrc/flash_attn", needs_cutlass=True, attention=True),
    "fused_dense_lib": dict(folder="csrc/fused_dense_lib", libraries=["cublasLt", "cublas"],
                            nvidia_wheels=("cublas",)),
    "dropout_layer_norm": dict(folder="csrc/layer_norm"),
}


def read_version():
    text = (ROOT / "flash_attn" / "__init__.py").read_text()
    return re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.M).group(1)


def env_flag(name):
    return os.getenv(name, "FALSE").strip().upper() in ("1", "TRUE", "YES", "ON")


def env_list(name, default):
    raw = os.getenv(name)
    if not raw:
        return list(default)
    return [item.strip() for item in re.split(r"[;,\s]+", raw) if item.strip()]


def cuda_build_reason_to_skip():
    """None when the CUDA extensions can be built here, else why not."""
    if env_flag("FLASH_ATTENTION_SKIP_CUDA_BUILD"):
        return "FLASH_ATTENTION_SKIP_CUDA_BUILD is set"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return "PyTorch is not installed (install it first, then build with --no-build-isolation)"
    if torch.version.cuda is None:
        return f"PyTorch {torch.__version__} is a CPU build"
    if CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) was found; set CUDA_HOME"
    return None


def cutlass_include_dir():
    try:
        return build_flags.cutlass_include_dir()
    except FileNotFoundError as err:
        sys.exit(f"flash_attn: {err}")


def use_host_compiler():
    """Exports CXX and CC (nvcc's host compiler too) as csrc/host_compiler.py chooses them."""
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    def probe(cxx):
        return host_compiler.throw_probe(cxx, include_paths(), library_paths()[0], sys.executable)

    try:
        choice = host_compiler.choose(torch.__config__.show(), dict(os.environ), probe=probe)
    except host_compiler.HostCompilerError as err:
        sys.exit(f"flash_attn: {err}")
    os.environ["CXX"], os.environ["CC"] = choice.cxx, choice.cc
    print(f"flash_attn: {choice.message}")


def nvidia_wheel_dirs(component):
    """Include and library folders of an NVIDIA runtime wheel (nvidia-cublas and friends)."""
    include_dirs, library_dirs = [], []
    for entry in sys.path:
        for sub in (f"nvidia/{component}", "nvidia/cu13", "nvidia/cu12"):
            base = Path(entry) / sub
            if (base / "include").is_dir():
                include_dirs.append(str(base / "include"))
            if (base / "lib").is_dir():
                library_dirs.append(str(base / "lib"))
    return include_dirs, library_dirs


def link_flags(libraries, library_dirs):
    """-l flags of the libraries: -lNAME where libNAME.so exists (the toolkit), else
    -l:libNAME.so.N, the versioned file a runtime wheel alone ships (nvidia-cublas has no
    unversioned libcublasLt.so)."""
    from torch.utils.cpp_extension import CUDA_HOME

    search = [Path(CUDA_HOME) / "lib64", Path(CUDA_HOME) / "lib"] + [Path(d) for d in library_dirs]
    flags = []
    for name in libraries:
        if any((d / f"lib{name}.so").exists() for d in search):
            flags.append(f"-l{name}")
            continue
        versioned = sorted(p.name for d in search if d.is_dir() for p in d.glob(f"lib{name}.so.*"))
        flags.append(f"-l:{versioned[0]}" if versioned else f"-l{name}")
    return flags


def cuda_archs():
    archs = env_list("FLASH_ATTN_CUDA_ARCHS", [])
    if not archs:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            archs = [f"{major}{minor}"]
        else:
            archs = ["80", "90"]
    return archs


def attention_sources(folder, archs):
    """Generated instantiation units of the attention kernels selected by FLASH_ATTN_HDIMS/DTYPES
    (default: generate_kernels.default_head_dims for the archs; "all": every head dim)."""
    generator = load_module("generate_kernels", f"{folder}/generate_kernels.py")
    try:
        hdims, dtypes = generator.selected_kernel_set(archs, os.environ)  # the kernel set lives there
    except ValueError as error:
        sys.exit(f"flash_attn: {error}")
    generated = generator.write_instantiations(ROOT / folder / "src" / "generated", hdims, dtypes)
    return [os.path.relpath(p, ROOT) for p in sorted(generated, key=compile_cost, reverse=True)]


def compile_cost(unit):
    """Rough relative compile time of an attention unit: ninja starts units in the order given, so
    the longest go first and the last ones to finish are short (the build's tail)."""
    name = Path(unit).stem
    head_dim = int(re.search(r"hdim(\d+)", name).group(1))
    return (2 if name.startswith("flash_bwd") else 1, head_dim, "_dropout" in name, "_masked" in name)


def split_prebuilt(units, folder, cutlass_dir, key_flags):
    """(units to compile, objects to link): a unit whose object in FLASH_ATTN_PREBUILT_DIR was
    compiled from the same sources and flags (build_flags.unit_key) is linked, not compiled."""
    prebuilt = os.getenv("FLASH_ATTN_PREBUILT_DIR")
    if not prebuilt:
        return units, []
    to_compile, objects = [], []
    for unit in units:
        key = build_flags.unit_key(ROOT / unit, ROOT / folder / "src", cutlass_dir, key_flags)
        obj = build_flags.prebuilt_object(prebuilt, unit, key)
        if obj is not None:
            objects.append(str(obj))
        else:
            to_compile.append(unit)
    print(f"flash_attn: {len(objects)} attention units prebuilt in {prebuilt}, {len(to_compile)} to compile")
    return to_compile, objects


def cuda_extensions():
    reason = cuda_build_reason_to_skip()
    if reason is not None:
        print(f"flash_attn: building the Python package only ({reason}).")
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    wanted = env_list("FLASH_ATTN_EXTENSIONS", EXTENSIONS)
    archs = cuda_archs()
    nvcc_threads = os.getenv("NVCC_THREADS", "2")
    key_flags = build_flags.kernel_flags(archs)
    common_nvcc = key_flags + ["--threads", nvcc_threads]
    use_host_compiler()
    print(f"flash_attn: building the CUDA extensions {wanted} for sm {archs} with "
          f"MAX_JOBS={os.getenv('MAX_JOBS', 'auto')}")

    extensions = []
    for name in wanted:
        if name not in EXTENSIONS:
            sys.exit(f"flash_attn: FLASH_ATTN_EXTENSIONS names unknown extension {name!r}; "
                     f"choose from {list(EXTENSIONS)}")
        row = EXTENSIONS[name]
        folder = row["folder"]
        sources = sorted(
            os.path.relpath(p, ROOT)
            for pattern in ("*.cpp", "*.cu", "src/*.cu")
            for p in glob.glob(str(ROOT / folder / pattern))
        )
        if not sources:
            continue  # this extension has not been written yet
        include_dirs = [str(ROOT / folder), str(ROOT / folder / "src")]
        library_dirs, extra_objects, system_includes = [], [], []
        if row.get("needs_cutlass"):
            include_dirs.append(cutlass_include_dir())
        for component in row.get("nvidia_wheels", ()):
            inc, lib = nvidia_wheel_dirs(component)
            # -isystem: searched after the toolkit's -I folder, so the wheel supplies only the
            # headers the toolkit lacks (cublasLt.h), never a second copy of the CUDA runtime's.
            system_includes += [flag for d in inc for flag in ("-isystem", d)]
            library_dirs += lib
        if row.get("attention"):
            units, extra_objects = split_prebuilt(attention_sources(folder, archs), folder,
                                                  cutlass_include_dir(), key_flags)
            print(f"flash_attn: {len(units) + len(extra_objects)} attention kernel units")
            sources += units
        extensions.append(
            CUDAExtension(
                name=name,
                sources=sources,
                include_dirs=include_dirs,
                library_dirs=library_dirs,
                extra_link_args=link_flags(row.get("libraries", []), library_dirs),
                extra_objects=extra_objects,
                extra_compile_args={"cxx": ["-O3"] + system_includes,
                                    "nvcc": common_nvcc + system_includes},
            )
        )
    return extensions, {"build_ext": parallel_build_ext(BuildExtension).with_options(use_ninja=True)}


def parallel_build_ext(base):
    """torch's BuildExtension with the extensions built concurrently: each gets a build_temp of
    its own (torch writes one build.ninja per compile call into it), and setuptools' parallel
    mode runs one thread per extension."""

    class ParallelBuildExtension(base):
        def build_extensions(self):
            self.parallel = max(1, len(self.extensions))
            super().build_extensions()

        def build_extension(self, ext):
            worker = copy.copy(self)
            worker.build_temp = os.path.join(self.build_temp, ext.name)
            start = time.time()
            super(ParallelBuildExtension, worker).build_extension(ext)
            print(f"flash_attn: built {ext.name} in {time.time() - start:.0f} s", flush=True)

    return ParallelBuildExtension


ext_modules, cmdclass = cuda_extensions()

setup(
    name=PACKAGE_NAME,
    version=read_version(),
    description="Flash attention, fused dense and fused layer norm for PyTorch",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["flash_attn", "flash_attn.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.9",
    install_requires=["torch", "einops"],
)
