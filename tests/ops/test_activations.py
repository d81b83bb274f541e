"""flash_attn.ops.activations against PyTorch autograd of the same formulas (CPU and CUDA)."""

import math

import pytest
import torch
import torch.nn.functional as F

from flash_attn.ops.activations import (
    bias_gelu,
    bias_gelu_back,
    bias_gelu_impl,
    fast_gelu_impl,
    gelu_bwd,
    gelu_fwd,
    relu_bwd,
    sqrelu_bwd,
    sqrelu_fwd,
    swiglu,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tanh_gelu_reference(x):
    """The tanh approximation written out, in float64."""
    x = x.double()
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def autograd_of(fn, *inputs, grad):
    inputs = [t.detach().double().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(grad.double())
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_fwd_bwd(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 129, device=device, dtype=dtype) * 3
    g = torch.randn_like(x)
    ref_out, (ref_grad,) = autograd_of(tanh_gelu_reference, x, grad=g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert gelu_fwd(x).dtype == dtype
    torch.testing.assert_close(gelu_fwd(x).double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(gelu_bwd(g, x).double(), ref_grad, atol=tol, rtol=tol)
    # Same bits as PyTorch's own tanh-GELU autograd: the unfused MLP path must match a plain MLP.
    xr = x.clone().requires_grad_()
    F.gelu(xr, approximate="tanh").backward(g)
    assert torch.equal(gelu_bwd(g, x), xr.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gelu_and_autograd_functions(device):
    torch.manual_seed(0)
    y = torch.randn(5, 7, 16, device=device)
    bias = torch.randn(16, device=device)
    g = torch.randn_like(y)
    ref_out, (ref_dy, ref_db) = autograd_of(lambda a, b: tanh_gelu_reference(a + b), y, bias, grad=g)
    torch.testing.assert_close(bias_gelu(y, bias).double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias_gelu_back(g, y, bias).double(), ref_dy, atol=1e-5, rtol=1e-5)

    yr, br = y.clone().requires_grad_(), bias.clone().requires_grad_()
    bias_gelu_impl(yr, br).backward(g)
    torch.testing.assert_close(yr.grad.double(), ref_dy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(br.grad.double(), ref_db, atol=1e-4, rtol=1e-5)

    yr = y.clone().requires_grad_()
    fast_gelu_impl(yr).backward(g)
    _, (ref_fast,) = autograd_of(tanh_gelu_reference, y, grad=g)
    torch.testing.assert_close(yr.grad.double(), ref_fast, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_relu_bwd(device):
    x = torch.tensor([-2.0, -0.0, 0.0, 1e-30, 3.0], device=device)
    g = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], device=device)
    expected = torch.tensor([0.0, 0.0, 0.0, 4.0, 5.0], device=device)
    assert torch.equal(relu_bwd(g, x), expected)
    # The ReLU output carries the same sign information as its input.
    assert torch.equal(relu_bwd(g, F.relu(x)), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sqrelu(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 33, device=device, dtype=dtype)
    g = torch.randn_like(x)
    ref_out, (ref_grad,) = autograd_of(lambda t: F.relu(t) ** 2, x, grad=g)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert sqrelu_fwd(x).dtype == dtype and sqrelu_bwd(g, x).dtype == dtype
    torch.testing.assert_close(sqrelu_fwd(x).double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(sqrelu_bwd(g, x).double(), ref_grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(17, 48, device=device, dtype=dtype)
    y = torch.randn_like(x)
    g = torch.randn_like(x)
    ref_out, (ref_dx, ref_dy) = autograd_of(lambda a, b: F.silu(a) * b, x, y, grad=g)
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    out = swiglu(xr, yr)
    out.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and xr.grad.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(xr.grad.double(), ref_dx, atol=tol, rtol=tol)
    torch.testing.assert_close(yr.grad.double(), ref_dy, atol=tol, rtol=tol)
