"""What the tests of this folder compile with: nvcc, the CUTLASS headers (found as setup.py finds
them, csrc/build_flags.py) and, to read SASS, cuobjdump (the CUDA toolkit's, or the one Triton
ships). A test asking for one that is missing skips."""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def build_flags():
    # Loaded from its file: csrc/ on sys.path would make its extension folders (csrc/fused_dense_lib)
    # importable as namespace packages and fool the extension checks of other tests.
    spec = importlib.util.spec_from_file_location("build_flags", ROOT / "csrc" / "build_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def cutlass_include(build_flags):
    """The CUTLASS include folder, for a test that runs nvcc."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    try:
        return build_flags.cutlass_include_dir()
    except FileNotFoundError:
        pytest.skip("needs the CUTLASS headers (pip install --no-deps nvidia-cutlass, or CUTLASS_PATH)")


@pytest.fixture(scope="session")
def cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.is_file():
            return str(bundled)
    pytest.skip("needs cuobjdump")
