"""The device every Triton launcher of flash_attn.ops.triton runs its kernels on, checked in one
place: a CUDA tensor, or a CPU tensor when Triton's interpreter is on (TRITON_INTERPRET=1).

Without the interpreter Triton has no CPU backend and fails with "0 active drivers ([]). There
should only be one.", which names neither the op nor the tensor; launch_device says both.
"""

import functools
import os
from contextlib import nullcontext

import torch
import triton


def triton_interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its interpreter, read now (not at import) from
    TRITON_INTERPRET, with Triton's own parsing where it has one."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # older Triton's own test


def launch_device(op_name: str, arg_name: str, tensor: torch.Tensor):
    """Context manager to launch op_name's kernels on tensor's device (its CUDA device current).
    Raises RuntimeError for a CPU tensor unless the Triton interpreter is on."""
    # CUDA first: under torch.compile this is a static property of the traced tensor, so the
    # environment is never read (Dynamo cannot trace Triton's C++ getenv).
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    if tensor.device.type == "cpu" and not triton_interpreter_enabled():
        raise RuntimeError(
            f"{op_name}: {arg_name} is a CPU tensor, but its Triton kernel needs a CUDA tensor. "
            "Move the inputs to a GPU, or set TRITON_INTERPRET=1 before flash_attn is imported "
            "to run the kernel in the Triton interpreter on CPU (slow; for tests).")
    return nullcontext()


@functools.lru_cache(maxsize=None)
def sm_count(device_index):
    """Streaming multiprocessors of a CUDA device: what the launchers size persistent grids by
    (cached: the host's cost per launch counts at small sizes)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
