"""Casts of a layer's parameters (up to four tensors: a GEMM's weight and bias, or an MLP's two of
each) to the compute dtype in one kernel.

Under autocast on fp32 parameters every fused layer casts its weights and biases in each forward:
GPT-2 medium's step ran 194 cast kernels (0.85 ms), half of them on biases of a few thousand
elements, whose launch and ramp cost more than their bytes. One launch per layer moves the same
bytes; flash_attn.ops.fused_dense uses it while a CUDA graph captures (_cast).
"""

import torch
import triton
import triton.language as tl

from flash_attn.ops.triton.launch_device import launch_device

MAX_TENSORS = 4
_BLOCK = 4096  # elements per program; a tensor's output starts on a block, so a block has one source


@triton.jit
def _cast_block(SRC, OUT, numel, block, first_block, BLOCK: tl.constexpr):
    offsets = (block - first_block).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    values = tl.load(SRC + offsets, mask=mask)
    tl.store(OUT + block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK),
             values.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _cast_kernel(SRC0, SRC1, SRC2, SRC3, OUT, NUMEL0, NUMEL1, NUMEL2, NUMEL3, FIRST1, FIRST2, FIRST3,
                 BLOCK: tl.constexpr):
    # Tensor k's blocks are [FIRST_k, FIRST_k+1); an absent tensor has no blocks.
    block = tl.program_id(0)
    if block < FIRST1:
        _cast_block(SRC0, OUT, NUMEL0, block, 0, BLOCK)
    elif block < FIRST2:
        _cast_block(SRC1, OUT, NUMEL1, block, FIRST1, BLOCK)
    elif block < FIRST3:
        _cast_block(SRC2, OUT, NUMEL2, block, FIRST2, BLOCK)
    else:
        _cast_block(SRC3, OUT, NUMEL3, block, FIRST3, BLOCK)


def cast_tensors(dtype, tensors):
    """The tensors (1 to MAX_TENSORS, contiguous, one dtype and device) cast to dtype, as views of
    one buffer, by one kernel."""
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise ValueError(f"cast_tensors: takes 1 to {MAX_TENSORS} tensors, got {len(tensors)}")
    first = tensors[0]
    for index, t in enumerate(tensors):
        if t.dtype != first.dtype or t.device != first.device or not t.is_contiguous():
            raise ValueError(f"cast_tensors: tensors[{index}] must be contiguous with the dtype and "
                             f"device of tensors[0] ({first.dtype}, {first.device}); got {t.dtype}, "
                             f"{t.device}, contiguous={t.is_contiguous()}")
    device = launch_device("cast_tensors", "tensors[0]", first)
    blocks = [triton.cdiv(t.numel(), _BLOCK) for t in tensors]
    starts = [sum(blocks[:k]) for k in range(len(tensors) + 1)]
    out = torch.empty(starts[-1] * _BLOCK, dtype=dtype, device=first.device)
    casts = [out[start * _BLOCK:start * _BLOCK + t.numel()].view(t.shape)
             for start, t in zip(starts, tensors)]
    if starts[-1] == 0:
        return casts
    pad = MAX_TENSORS - len(tensors)
    sources = list(tensors) + [first] * pad
    numels = [t.numel() for t in tensors] + [0] * pad
    firsts = starts[1:len(tensors)] + [starts[-1]] * (pad + 1)
    with device:
        _cast_kernel[(starts[-1],)](*sources, out, *numels, *firsts[:MAX_TENSORS - 1], BLOCK=_BLOCK,
                                    num_warps=4)
    return casts
