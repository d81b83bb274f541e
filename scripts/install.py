"""Sets up this checkout on a fresh machine, CPU or GPU, in the Python environment that runs it:

    python scripts/install.py

1. PyTorch, if it is not installed: a CUDA build where `nvidia-smi` answers, else the CPU build
   torch==2.13.0.
2. The test requirements (requirements-test.txt); on a CPU build of PyTorch also triton==3.9.0,
   whose interpreter runs the Triton kernels on CPU tensors (a CUDA build brings its own Triton).
3. The CUTLASS/CuTe headers (nvidia-cutlass, headers only), unless CUTLASS_PATH names them.
4. The package and its CUDA extensions: `pip install --no-build-isolation .`, whose whole output
   goes to build/install.log; the build's own lines (host compiler, what is built and why not,
   the time each extension took) are printed here.
5. A summary: which CUDA extensions import, or why they were not built.

Packages already installed are kept (nothing is fetched for them), so the script also runs on a
machine without a package index when what is missing comes from local wheels
(PIP_FIND_LINKS=DIR PIP_NO_INDEX=1). Build knobs (MAX_JOBS, FLASH_ATTN_CUDA_ARCHS, ...) pass
through the environment: see setup.py.
"""

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_TORCH = "torch==2.13.0"
CPU_TRITON = "triton==3.9.0"
CUTLASS = "nvidia-cutlass==4.2.0.0"
EXTENSIONS = ("flash_attn_2_cuda", "fused_dense_lib", "dropout_layer_norm")


def say(message):
    print(f"install: {message}", flush=True)


def pip(*args, log=None):
    command = [sys.executable, "-m", "pip", *args]
    if log is None:
        subprocess.run(command, check=True)
        return
    # Stream pip's verbose output into the log, echoing the build's own `flash_attn:` lines.
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, cwd=ROOT)
        for line in process.stdout:
            out.write(line)
            text = line.strip()
            if text.startswith("flash_attn:") or text.startswith("Successfully installed"):
                print(f"  {text}", flush=True)
        if process.wait() != 0:
            tail = Path(log).read_text().splitlines()[-40:]
            print("\n".join(tail))
            sys.exit(f"install: the build failed (exit {process.returncode}); whole log: {log}")


def installed(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_build():
    """(version, cuda version or None) of the installed PyTorch, asked in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__); "
                             "print(torch.version.cuda)"], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    version, cuda = result.stdout.split()[-2:]
    return version, None if cuda == "None" else cuda


def ensure_torch():
    build = torch_build()
    if build is None:
        has_gpu = shutil.which("nvidia-smi") is not None and subprocess.run(
            ["nvidia-smi"], capture_output=True).returncode == 0
        requirement = "torch" if has_gpu else CPU_TORCH
        say(f"PyTorch is not installed: installing {requirement} "
            f"({'a GPU answers nvidia-smi' if has_gpu else 'no GPU: the CPU build'})")
        pip("install", requirement)
        build = torch_build()
    version, cuda = build
    say(f"PyTorch {version} ({f'CUDA {cuda}' if cuda else 'CPU build'})")
    return cuda


def ensure_requirements(cuda):
    pip("install", "-q", "-r", str(ROOT / "requirements-test.txt"))
    if cuda is None and installed("triton") is None:
        pip("install", "-q", CPU_TRITON)
    say(f"requirements: {', '.join(f'{d} {installed(d)}' for d in ('triton', 'transformers', 'einops'))}")


def ensure_cutlass():
    if os.getenv("CUTLASS_PATH"):
        say(f"CUTLASS headers: CUTLASS_PATH={os.environ['CUTLASS_PATH']}")
        return
    if installed("nvidia-cutlass") is None:
        pip("install", "-q", "--no-deps", CUTLASS)  # headers only: skip its Python tooling's needs
    say(f"CUTLASS headers: nvidia-cutlass {installed('nvidia-cutlass')}")


def build():
    log = ROOT / "build" / "install.log"
    log.parent.mkdir(exist_ok=True)
    say(f"building: pip install --no-build-isolation -v . (log: {log.relative_to(ROOT)})")
    start = time.time()
    pip("install", "--no-build-isolation", "-v", ".", log=log)
    say(f"built and installed in {time.time() - start:.0f} s")
    return log


def report(log):
    """Which extensions import, in a fresh interpreter outside the checkout."""
    code = ("import importlib, torch\n"
            f"for name in {EXTENSIONS!r}:\n"
            "    try:\n"
            "        importlib.import_module(name); print(name, 'built')\n"
            "    except ImportError as error:\n"
            "        print(name, 'missing', error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path.home())
    lines = result.stdout.splitlines()
    built = [line.split()[0] for line in lines if line.split()[1:2] == ["built"]]
    skipped = [line for line in log.read_text().splitlines()
               if "building the Python package only" in line]
    if built:
        say(f"CUDA extensions built: {', '.join(built)}")
    missing = [name for name in EXTENSIONS if name not in built]
    if missing:
        why = skipped[-1].strip() if skipped else f"see {log}"
        say(f"CUDA extensions not built: {', '.join(missing)} ({why})")
    subprocess.run([sys.executable, "-c", "import flash_attn; print('install: flash_attn', "
                    "flash_attn.__version__, 'imports')"], check=True, cwd=Path.home())


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    cuda = ensure_torch()
    ensure_requirements(cuda)
    ensure_cutlass()
    report(build())


if __name__ == "__main__":
    main()
