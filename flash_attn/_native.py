"""Import of the native CUDA extensions, with one clear error when one is missing.

Every module that needs `flash_attn_2_cuda`, `fused_dense_lib` or `dropout_layer_norm` gets it
through `load_extension`, so a missing build always reads the same way and never surfaces as an
AttributeError deep inside a call.
"""

import importlib

BUILD_HINT = (
    "Build it from a checkout of this repository on a machine with nvcc and a CUDA build of "
    "PyTorch: `pip install --no-build-isolation .` (see README.md)."
)


class MissingExtensionError(ImportError):
    """A native extension of flash_attn is not built or failed to load."""


def load_extension(name):
    """Return the extension module `name`, or raise MissingExtensionError saying how to build it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise MissingExtensionError(
            f"flash_attn: the CUDA extension `{name}` is not built or failed to load ({error}). "
            + BUILD_HINT
        ) from error


def extension_available(name):
    """True when `name` imports; lets callers pick a fallback path without an exception."""
    try:
        load_extension(name)
    except MissingExtensionError:
        return False
    return True
