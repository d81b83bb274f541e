"""Compiles the attention kernel units ahead of `pip install`, on any machine with nvcc (no GPU or
CUDA PyTorch needed), so that a GPU machine only compiles the binding and links:

    python scripts/prebuild_kernels.py OUT_DIR [--archs 90] [--jobs 2] [--match flash_bwd]
    FLASH_ATTN_PREBUILT_DIR=OUT_DIR pip install --no-build-isolation .

It builds the kernel set setup.py builds for those archs (FLASH_ATTN_HDIMS / FLASH_ATTN_DTYPES
read the same way).

Each object is stored with its build_flags.unit_key; setup.py links it only while that key still
matches, and compiles the unit otherwise. Units whose object is current are skipped here too.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = ROOT / "csrc" / "flash_attn"


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--archs", default="90", help="compute capabilities, as FLASH_ATTN_CUDA_ARCHS")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--match", default="", help="only units whose file name contains this")
    args = parser.parse_args()

    flags_mod = load_module("build_flags", ROOT / "csrc" / "build_flags.py")
    generator = load_module("generate_kernels", ATTENTION / "generate_kernels.py")
    cutlass = flags_mod.cutlass_include_dir()
    archs = args.archs.replace(";", ",").split(",")
    key_flags = flags_mod.kernel_flags(archs)
    # What torch's BuildExtension adds for every CUDA source of an extension.
    compile_flags = key_flags + ["-Xcompiler", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=1", "-Xptxas", "-v",
                                 "-I", str(ATTENTION), "-I", str(ATTENTION / "src"), "-I", cutlass]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:  # the kernel set setup.py builds for these archs
        hdims, dtypes = generator.selected_kernel_set(archs, os.environ)
    except ValueError as error:
        sys.exit(f"prebuild_kernels: {error}")
    units = [u for u in generator.write_instantiations(ATTENTION / "src" / "generated", hdims, dtypes)
             if args.match in u.name]

    def build(unit):
        key = flags_mod.unit_key(unit, ATTENTION / "src", cutlass, key_flags)
        if flags_mod.prebuilt_object(out_dir, unit, key) is not None:
            return unit.name, "current"
        obj, key_file, log = (out_dir / (unit.stem + ext) for ext in (".o", ".key", ".log"))
        start = time.time()
        tmp = obj.with_suffix(".o.tmp")
        result = subprocess.run(["nvcc", *compile_flags, "-c", str(unit), "-o", str(tmp)],
                                capture_output=True, text=True)
        log.write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            return unit.name, f"FAILED (see {log})"
        tmp.replace(obj)
        key_file.write_text(key + "\n")
        return unit.name, f"compiled in {time.time() - start:.0f} s"

    failed = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for name, status in pool.map(build, units):
            print(f"{name}: {status}", flush=True)
            failed += status.startswith("FAILED")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
