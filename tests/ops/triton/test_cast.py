"""Triton cast_tensors (a layer's parameters cast in one kernel) against torch's .to(): the same
values, the same shapes. On CPU the kernel runs in the Triton interpreter, which rounds fp32 to
bf16 toward zero (numpy has no bf16; the GPU rounds to nearest even, as torch does)."""

import pytest
import torch

from flash_attn.ops.triton.cast import MAX_TENSORS, cast_tensors
from flash_attn.ops.triton.launch_device import triton_interpreter_enabled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(t, dtype):
    if dtype == torch.bfloat16 and t.device.type == "cpu" and triton_interpreter_enabled():
        return (t.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # toward zero, exact
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shapes", [[(24, 16)], [(24, 16), (24,)], [(3000, 7), (5,), (0,), (4097,)],
                                    [(4096,), (1,), (2, 4096), (8193,)]])
def test_cast_tensors(dtype, shapes):
    torch.manual_seed(0)
    tensors = [torch.randn(*shape, device=DEVICE) for shape in shapes]
    casts = cast_tensors(dtype, tensors)
    assert len(casts) == len(tensors)
    for cast, t in zip(casts, tensors):
        assert cast.shape == t.shape and cast.dtype == dtype and cast.is_contiguous()
        assert torch.equal(cast, _expected(t, dtype))


def test_cast_tensors_empty():
    casts = cast_tensors(torch.float16, [torch.empty(0, 3, device=DEVICE)])
    assert casts[0].shape == (0, 3) and casts[0].dtype == torch.float16


@pytest.mark.parametrize("tensors,what", [
    (lambda: [], "takes 1 to"),
    (lambda: [torch.randn(2)] * (MAX_TENSORS + 1), "takes 1 to"),
    (lambda: [torch.randn(2), torch.randn(2, dtype=torch.float64)], r"tensors\[1\] must be contiguous"),
    (lambda: [torch.randn(4, 3).t()], r"tensors\[0\] must be contiguous"),
])
def test_cast_tensors_rejects(tensors, what):
    with pytest.raises(ValueError, match=f"cast_tensors: {what}"):
        cast_tensors(torch.float16, [t.to(DEVICE) for t in tensors()])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_tensors_gpu_gpt_layer(dtype):
    """GPT-2 medium's MLP parameters, bitwise what autocast's per-tensor casts give."""
    torch.manual_seed(0)
    tensors = [torch.randn(4096, 1024, device="cuda"), torch.randn(4096, device="cuda"),
               torch.randn(1024, 4096, device="cuda") * 1e3, torch.randn(1024, device="cuda") * 1e-6]
    for cast, t in zip(cast_tensors(dtype, tensors), tensors):
        assert torch.equal(cast, t.to(dtype))
