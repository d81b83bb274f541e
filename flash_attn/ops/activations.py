"""Activations used by the fused dense / MLP layers, with their hand-written backward formulas.

Plain PyTorch: every function works on CPU and CUDA tensors of any float dtype. Where PyTorch has a
single fused kernel for a formula (the tanh-approximate GELU and its backward, ReLU's backward)
that kernel is used, so the unfused MLP path costs one elementwise pass per step and matches
`F.gelu(x, approximate="tanh")` / `F.relu` autograd bit for bit.
"""

import torch
import torch.nn.functional as F


def gelu_fwd(x):
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F.gelu(x, approximate="tanh")


def gelu_bwd(g, x):
    """Gradient of gelu_fwd at x, times g; in x's dtype (computed in fp32 for half inputs)."""
    return torch.ops.aten.gelu_backward(g.to(x.dtype), x, approximate="tanh")


def bias_gelu(y, bias):
    """gelu_fwd(y + bias)."""
    return gelu_fwd(y + bias)


def bias_gelu_back(g, y, bias):
    """Gradient of bias_gelu with respect to y (and, summed over the leading dims, to bias)."""
    return gelu_bwd(g, y + bias)


class GeLUFunction(torch.autograd.Function):
    """gelu(input + bias) that saves only its two inputs for backward."""

    @staticmethod
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return bias_gelu(input, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        grad = bias_gelu_back(grad_output, input, bias)
        grad_bias = grad.reshape(-1, *bias.shape).sum(0) if grad.dim() > bias.dim() else grad
        return grad, grad_bias.to(bias.dtype)


bias_gelu_impl = GeLUFunction.apply


class FastGeLUFunction(torch.autograd.Function):
    """gelu_fwd with the gradient from gelu_bwd."""

    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return gelu_fwd(input)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        return gelu_bwd(grad_output, input)


fast_gelu_impl = FastGeLUFunction.apply


def relu_bwd(g, x):
    """Gradient of ReLU: g where x > 0, else 0 (x may be the ReLU's input or its output)."""
    return torch.ops.aten.threshold_backward(g.to(x.dtype), x, 0)


def sqrelu_fwd(x):
    """Squared ReLU (Primer): relu(x)^2, in x's dtype."""
    r = F.relu(x)
    return (r * r).to(dtype=x.dtype)


def sqrelu_bwd(g, x):
    """Gradient of sqrelu_fwd at x, times g: 2 g relu(x)."""
    return (2.0 * g * F.relu(x)).to(dtype=x.dtype)


def swiglu_fwd(x, y):
    """silu(x) * y, computed in fp32, in x's dtype."""
    return (F.silu(x.float()) * y.float()).to(x.dtype)


def swiglu_bwd(g, x, y):
    """(d/dx, d/dy) of swiglu_fwd at (x, y), times g."""
    xf, yf, gf = x.float(), y.float(), g.float()
    sig = torch.sigmoid(xf)
    dx = sig * (1 + xf * (1 - sig)) * gf * yf
    dy = xf * sig * gf
    return dx.to(x.dtype), dy.to(y.dtype)


class SwiGLUFunction(torch.autograd.Function):
    """silu(x) * y (the gate of Llama-style MLPs), computed in fp32 and saving only x and y."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return swiglu_fwd(x, y)

    @staticmethod
    def backward(ctx, dout):
        x, y = ctx.saved_tensors
        return swiglu_bwd(dout, x, y)


swiglu = SwiGLUFunction.apply
