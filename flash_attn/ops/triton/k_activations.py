"""Activations and their derivatives as Triton device functions, for the epilogues of the Triton
GEMMs (flash_attn.ops.triton.linear), with the same formulas in plain PyTorch beside them.

The device functions take and return the fp32 accumulator of a GEMM tile. Each `*_grad(x)` is the
derivative at the activation's input x (what the backward multiplies the incoming gradient by).
At a kink (x = 0) the derivative is PyTorch autograd's: 0 for ReLU, the negative slope for leaky
ReLU.
"""

import math
from enum import Enum
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flash_attn.ops.activations import gelu_fwd, sqrelu_fwd

# constexpr: the only globals a Triton function may read (`.value` in the PyTorch code). In the
# device functions they stand right of a tensor: the interpreter mishandles constexpr * tensor.
_SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
_SQRT_1_2 = tl.constexpr(math.sqrt(0.5))
_INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
_GELU_CUBIC = tl.constexpr(0.044715)
_LEAKY_SLOPE = tl.constexpr(0.01)  # F.leaky_relu's default


class Activation(str, Enum):
    SquaredReLU = "squared_relu"
    GeLU = "gelu"
    GeLUApprox = "gelu_approx"
    LeakyReLU = "leaky_relu"
    ReLU = "relu"


# ----------------------------------------------------------------------------------------------
# Triton device functions.
# ----------------------------------------------------------------------------------------------


@triton.jit
def tanh(x):
    # Through exp: Triton's core language has no tanh that every backend (the CPU interpreter
    # included) provides. exp(2x) = inf gives 1, exp(2x) = 0 gives -1: no NaN at the tails.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def cosh(x):
    exp_x = tl.exp(x)
    return (exp_x + 1.0 / exp_x) * 0.5


@triton.jit
def relu(x):
    return tl.where(x > 0, x, 0.0)


@triton.jit
def relu_grad(x):
    return tl.where(x > 0, 1.0, 0.0)


@triton.jit
def squared_relu(x):
    """relu(x)^2 (Primer, So et al. 2021)."""
    r = relu(x)
    return r * r


@triton.jit
def squared_relu_grad(x):
    return 2.0 * relu(x)


@triton.jit
def leaky_relu(x):
    return tl.where(x > 0, x, x * _LEAKY_SLOPE)


@triton.jit
def leaky_relu_grad(x):
    return tl.where(x > 0, 1.0, _LEAKY_SLOPE)


@triton.jit
def gelu(x):
    """x Phi(x), Phi the standard normal CDF (the exact GELU)."""
    return 0.5 * x * (1.0 + tl.erf(x * _SQRT_1_2))


@triton.jit
def gelu_grad(x):
    cdf = 0.5 * (1.0 + tl.erf(x * _SQRT_1_2))
    pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return cdf + x * pdf


@triton.jit
def gelu_approx(x):
    """GELU with the tanh approximation: 0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3)."""
    # 0.5 (1 + tanh(z)) = 1 / (1 + exp(-2z)): no cancellation in the negative tail, where
    # 1 + tanh(z) would lose every digit.
    z = x * _SQRT_2_OVER_PI * (1.0 + x * x * _GELU_CUBIC)
    return x / (1.0 + tl.exp(-2.0 * z))


@triton.jit
def gelu_approx_grad(x):
    # With s = 0.5 (1 + tanh(z)): d/dx = s + 2 x s (1 - s) dz/dx. s and 1 - s each from its own
    # exp, so that neither is a difference of nearly equal numbers.
    z = x * _SQRT_2_OVER_PI * (1.0 + x * x * _GELU_CUBIC)
    s = 1.0 / (1.0 + tl.exp(-2.0 * z))
    one_minus_s = 1.0 / (1.0 + tl.exp(2.0 * z))
    dz = (1.0 + x * x * _GELU_CUBIC * 3.0) * _SQRT_2_OVER_PI
    return s + 2.0 * x * s * one_minus_s * dz


_KERNELS = {
    Activation.ReLU: (relu, relu_grad),
    Activation.LeakyReLU: (leaky_relu, leaky_relu_grad),
    Activation.GeLU: (gelu, gelu_grad),
    Activation.GeLUApprox: (gelu_approx, gelu_approx_grad),
    Activation.SquaredReLU: (squared_relu, squared_relu_grad),
}


def get_triton_activation_kernel(activation: Optional[Activation]):
    """The device function of an activation (None for None)."""
    return _KERNELS[Activation(activation)][0] if activation else None


def get_triton_activation_bwd_kernel(activation: Optional[Activation]):
    """The device function of an activation's derivative (None for None)."""
    return _KERNELS[Activation(activation)][1] if activation else None


# ----------------------------------------------------------------------------------------------
# The same in PyTorch: the references of the kernels' epilogues.
# ----------------------------------------------------------------------------------------------


def activation_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    """activation(x) in x's dtype; "id" is the identity."""
    if activation == "id":
        return x
    return {
        Activation.ReLU: F.relu,
        Activation.LeakyReLU: lambda t: F.leaky_relu(t, _LEAKY_SLOPE.value),
        Activation.GeLU: F.gelu,
        Activation.GeLUApprox: gelu_fwd,
        Activation.SquaredReLU: sqrelu_fwd,
    }[Activation(activation)](x)


def activation_grad_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The derivative of activation at x, in x's dtype: the closed forms the kernels use."""
    if activation == "id":
        return torch.ones_like(x)
    activation = Activation(activation)
    if activation == Activation.ReLU:
        return (x > 0).to(x.dtype)
    if activation == Activation.LeakyReLU:
        return torch.ones_like(x).masked_fill_(x <= 0, _LEAKY_SLOPE.value)
    if activation == Activation.SquaredReLU:
        return 2.0 * F.relu(x)
    if activation == Activation.GeLU:
        cdf = 0.5 * (1.0 + torch.erf(x * _SQRT_1_2.value))
        return cdf + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI.value
    c, a = _SQRT_2_OVER_PI.value, _GELU_CUBIC.value
    t = torch.tanh(c * x * (1.0 + a * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x)
