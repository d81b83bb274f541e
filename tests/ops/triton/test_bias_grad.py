"""Triton bias_grad (a Linear's bias gradient: the output gradient summed over rows) against an
fp64 sum. On CPU the kernel runs in the Triton interpreter on small shapes; the GPU tests take the
shapes of GPT-2's layers, CUDA graph capture and run-to-run repeatability."""

import pytest
import torch

from flash_attn.ops.triton import bias_grad as bg
from flash_attn.ops.triton.bias_grad import bias_grad

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(grad_output, out_dtype=None):
    out = bias_grad(grad_output, out_dtype)
    ref = grad_output.double().sum(0)
    assert out.shape == ref.shape and out.dtype == (out_dtype or grad_output.dtype)
    # A sum of n terms in precision u errs by at most n * u * sum|x| (fp32 accumulation, fp64 for
    # fp64 input), then the output dtype rounds once.
    acc_u = torch.finfo(torch.float64 if grad_output.dtype == torch.float64 else torch.float32).eps / 2
    out_u = torch.finfo(out.dtype).eps / 2
    tol = grad_output.shape[0] * acc_u * grad_output.double().abs().sum(0) + out_u * ref.abs()
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"error {err.max().item():.3g}"
    return out


@pytest.mark.parametrize("shape", [(1, 1), (7, 37), (100, 129), (300, 5), (65, 256)])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                             (torch.float16, None), (torch.float64, None)])
def test_bias_grad(shape, dtype, out_dtype):
    torch.manual_seed(0)
    _check(torch.randn(*shape, dtype=dtype, device=DEVICE), out_dtype)


def test_bias_grad_several_bands():
    """More row bands than one, so that the last program of each column block adds the others'
    partial rows (also in the interpreter, which counts 2 SMs)."""
    torch.manual_seed(0)
    grad_output = torch.randn(1000, 300, dtype=torch.float64, device=DEVICE)
    block_m, block_n, _, per_sm = bg._config(300)
    assert -(-1000 // block_m) > 1 and per_sm * bg._sm_count(grad_output.device) > 2
    _check(grad_output)


def test_bias_grad_strided_rows():
    """Rows further apart than their length (a column slice of a wider tensor)."""
    torch.manual_seed(0)
    wide = torch.randn(50, 80, dtype=torch.float32, device=DEVICE)
    out = _check(wide[:, 10:47])
    torch.testing.assert_close(out, wide[:, 10:47].sum(0), rtol=1e-5, atol=1e-5)


def test_bias_grad_empty():
    assert bias_grad(torch.empty(0, 5, device=DEVICE)).tolist() == [0.0] * 5
    assert bias_grad(torch.empty(4, 0, device=DEVICE)).shape == (0,)


@pytest.mark.parametrize("bad,what", [
    (lambda: torch.randn(2, 3, 4), "2-D"),
    (lambda: torch.randn(6, 4).t(), "contiguous rows"),
    (lambda: torch.randn(5), "2-D"),
])
def test_bias_grad_rejects(bad, what):
    with pytest.raises(ValueError, match=f"bias_grad: grad_output must be .*{what}"):
        bias_grad(bad().to(DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(8192, 1024), (8192, 3072), (8192, 4096), (16384, 768),
                                       (16384, 2304), (1000, 50304), (3, 5000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_grad_gpu(rows, cols, dtype):
    torch.manual_seed(0)
    grad_output = torch.randn(rows, cols, dtype=dtype, device="cuda")
    first = _check(grad_output, torch.float32)
    for _ in range(3):  # the bands are added in one order, whichever program ends last
        assert torch.equal(bias_grad(grad_output, torch.float32), first)
    _check(grad_output)


@pytest.mark.gpu
def test_bias_grad_cuda_graph():
    grad_output = torch.randn(4096, 3072, dtype=torch.bfloat16, device="cuda")
    expected = bias_grad(grad_output, torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bias_grad(grad_output, torch.float32)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = bias_grad(grad_output, torch.float32)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)
    grad_output.mul_(2)  # the replay reads the captured input's new values
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, 2 * expected)
