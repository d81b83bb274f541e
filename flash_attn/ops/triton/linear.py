"""A Triton GEMM with the work around it fused into its epilogue, for MLP layers:

    triton_linear_act(x, weight, bias, activation)   out = activation(x @ weight.T + bias)
                                                     (and, saved for the backward, the
                                                     pre-activation act_input)
    triton_dgrad_act(grad_output, weight, activation, act_input)
                                                     grad_input = (grad_output @ weight)
                                                                  * activation'(act_input)

One kernel serves both: the same tiled main loop (fp32 accumulator) with two epilogues. Inputs
are float16, bfloat16 or float32 (products in full fp32 unless torch allows TF32 matmuls), the
outputs in the input dtype. Activations: "id" (none) and those of k_activations.
Plain-PyTorch references of both (linear_act_ref, dgrad_act_ref) follow the launchers.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flash_attn.ops.triton.k_activations import (
    Activation,
    activation_grad_ref,
    activation_ref,
    gelu,
    gelu_approx,
    gelu_approx_grad,
    gelu_grad,
    leaky_relu,
    leaky_relu_grad,
    relu,
    relu_grad,
    squared_relu,
    squared_relu_grad,
)
from flash_attn.ops.triton.launch_device import launch_device

ACTIVATIONS = ("id",) + tuple(a.value for a in Activation)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr, GRAD: tl.constexpr):
    """activation(x), or its derivative with GRAD, chosen at compile time."""
    y = x
    if ACTIVATION == "relu":
        y = relu_grad(x) if GRAD else relu(x)
    elif ACTIVATION == "leaky_relu":
        y = leaky_relu_grad(x) if GRAD else leaky_relu(x)
    elif ACTIVATION == "gelu":
        y = gelu_grad(x) if GRAD else gelu(x)
    elif ACTIVATION == "gelu_approx":
        y = gelu_approx_grad(x) if GRAD else gelu_approx(x)
    elif ACTIVATION == "squared_relu":
        y = squared_relu_grad(x) if GRAD else squared_relu(x)
    return y


@triton.jit
def _linear_act_kernel(
    C, ACT_INPUT, A, B, BIAS,
    M, N, K, M_BUCKET,
    stride_cm, stride_am, stride_ak, stride_bk, stride_bn,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_ACT_INPUT: tl.constexpr,
    ACT_GRAD: tl.constexpr, DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C (M, N) = epilogue(A (M, K) @ B (K, N)), C and ACT_INPUT row-major with unit column
    stride. Epilogue: without ACT_GRAD, + BIAS (N,), the sum stored to ACT_INPUT
    (SAVE_ACT_INPUT), then the activation; with ACT_GRAD, times activation'(ACT_INPUT)."""
    # Grouped order: GROUP_M row blocks sweep the column blocks together, so the B tiles they
    # share are still in L2 when the next row block asks for them.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge read a valid row / column again (index mod size) instead
    # of being masked in the main loop; the store drops their results.
    a_ptrs = A + (rm % M)[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + rk[:, None] * stride_bk + (rn % N)[None, :].to(tl.int64) * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if DOT_IN_FP32:
            # Triton's CPU interpreter gets bfloat16 dots wrong; the products of bfloat16
            # values are exact in fp32, so upcasting gives what the GPU computes.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_offs = rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    c_mask = (rm < M)[:, None] & (rn < N)[None, :]
    if ACT_GRAD:
        act_input = tl.load(ACT_INPUT + c_offs, mask=c_mask, other=0.0).to(tl.float32)
        acc = acc * _activation(act_input, ACTIVATION, True)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if SAVE_ACT_INPUT:
            tl.store(ACT_INPUT + c_offs, acc.to(ACT_INPUT.dtype.element_ty), mask=c_mask)
        acc = _activation(acc, ACTIVATION, False)
    tl.store(C + c_offs, acc.to(C.dtype.element_ty), mask=c_mask)


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


def _gpu_configs():
    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): large tiles for large GEMMs (Hopper's wgmma
    # works on 64-row multiples per warpgroup), smaller ones for few rows or fp32's larger tiles.
    shapes = [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8),
              (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
              (64, 64, 64, 4, 4), (128, 128, 32, 4, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
                          num_stages=s, num_warps=w) for m, n, k, s, w in shapes]


_SMALL_PROBLEM = 2**18  # output elements (M rounded up to a power of 2, times N)


def _prune_configs(configs, named_args, **kwargs):
    """Small problems (launch-bound, a few tiles) take one 64 x 64 tile without tuning; larger
    ones drop tiles much larger than the problem, which only add padding and tuning time."""
    m_bucket, n = named_args["M_BUCKET"], named_args["N"]
    if m_bucket * n <= _SMALL_PROBLEM:
        return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == (64, 64)]
    m_cap, n_cap = max(m_bucket, 64), max(triton.next_power_of_2(n), 64)
    return [c for c in configs if c.kwargs["BLOCK_M"] <= m_cap and c.kwargs["BLOCK_N"] <= n_cap]


_kernel = triton.heuristics({"EVEN_K": _even_k})(_linear_act_kernel)
# Tuned per (rows rounded up to a power of 2, N, K) and dtype, not per exact row count.
_kernel_tuned = triton.autotune(configs=_gpu_configs(), key=["M_BUCKET", "N", "K"],
                                prune_configs_by={"early_config_prune": _prune_configs})(_kernel)
# The interpreter runs a fixed small tile: autotuning there would time every config on CPU.
_INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}


def _launch(out, act_input, a, b, bias, stride_bk, stride_bn, activation, save_act_input,
            act_grad, op_name, a_name):
    """out (M, N) = epilogue(a (M, K) @ b), b read as (K, N) through (stride_bk, stride_bn);
    a_name: what the caller calls a (for the error on a CPU tensor)."""
    M, K = a.shape
    N = out.shape[1]
    device = launch_device(op_name, a_name, a)
    if M == 0 or N == 0:
        return
    interpreted = not a.is_cuda  # launch_device let a CPU tensor through: the interpreter is on
    fp32_products = a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    args = (out, act_input, a, b, bias, M, N, K, triton.next_power_of_2(M),
            out.stride(0), a.stride(0), a.stride(1), stride_bk, stride_bn)
    meta = dict(ACTIVATION=activation, HAS_BIAS=bias is not None, SAVE_ACT_INPUT=save_act_input,
                ACT_GRAD=act_grad, DOT_IN_FP32=interpreted and a.dtype == torch.bfloat16,
                INPUT_PRECISION="ieee" if fp32_products or interpreted else "tf32")
    def grid(config):
        return (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"]),)

    with device:
        if interpreted:
            _kernel[grid(_INTERPRETER_CONFIG)](*args, **meta, **_INTERPRETER_CONFIG)
        else:
            _kernel_tuned[grid](*args, **meta)


def _fail(op_name, name, expected, got):
    raise ValueError(f"{op_name}: {name} must be {expected}, got {got}")


def _check_activation(op_name, activation):
    if activation not in ACTIVATIONS:
        _fail(op_name, "activation", f"one of {ACTIVATIONS}", repr(activation))


def _check_operand(op_name, name, t, dims, like=None):
    """t is a float16/bfloat16/float32 tensor of `dims` dimensions (an int, or a minimum as
    (n,)), of like's dtype and device."""
    if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
        _fail(op_name, name, "a float16, bfloat16 or float32 tensor",
              getattr(t, "dtype", type(t).__name__))
    ok = t.dim() == dims if isinstance(dims, int) else t.dim() >= dims[0]
    if not ok:
        want = f"{dims}-D" if isinstance(dims, int) else f"at least {dims[0]}-D"
        _fail(op_name, name, want, f"shape {tuple(t.shape)}")
    if like is not None and (t.dtype != like[1].dtype or t.device != like[1].device):
        _fail(op_name, name, f"{like[1].dtype} on {like[1].device} like {like[0]}",
              f"{t.dtype} on {t.device}")


def triton_linear_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: str = "id",
    save_act_input: bool = False,
):
    """activation(x @ weight.T + bias) in one kernel. x (..., K), weight (N, K), bias (N,) or
    None, all of one dtype and device. Returns out (..., N), and with save_act_input also
    act_input (..., N): the pre-activation x @ weight.T + bias, which the backward needs."""
    op = "triton_linear_act"
    _check_activation(op, activation)
    _check_operand(op, "x", x, (1,))
    _check_operand(op, "weight", weight, 2, like=("x", x))
    N, K = weight.shape
    if x.shape[-1] != K:
        _fail(op, "weight", f"(N, {x.shape[-1]}) to match x's last dimension",
              f"shape {tuple(weight.shape)}")
    if bias is not None:
        _check_operand(op, "bias", bias, 1, like=("x", x))
        if bias.shape[0] != N:
            _fail(op, "bias", f"of shape ({N},) like weight's rows", f"shape {tuple(bias.shape)}")
    batch_shape = x.shape[:-1]
    x2d = x.reshape(-1, K)
    out = torch.empty(x2d.shape[0], N, device=x.device, dtype=x.dtype)
    act_input = torch.empty_like(out) if save_act_input else None
    _launch(out, act_input, x2d, weight, bias, weight.stride(1), weight.stride(0), activation,
            save_act_input, False, op, "x")
    out = out.view(*batch_shape, N)
    return (out, act_input.view(*batch_shape, N)) if save_act_input else out


def triton_dgrad_act(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    activation: str = "id",
    act_input: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The gradient at the input of activation, through the linear layer after it:
    (grad_output @ weight) * activation'(act_input). grad_output (..., N), weight (N, K) (that
    layer's weight), act_input (..., K) (the activation's saved input; needed unless activation
    is "id"), all of one dtype and device. Returns (..., K)."""
    op = "triton_dgrad_act"
    _check_activation(op, activation)
    _check_operand(op, "grad_output", grad_output, (1,))
    _check_operand(op, "weight", weight, 2, like=("grad_output", grad_output))
    N, K = weight.shape
    if grad_output.shape[-1] != N:
        _fail(op, "weight", f"({grad_output.shape[-1]}, K) to match grad_output's last "
              "dimension", f"shape {tuple(weight.shape)}")
    batch_shape = grad_output.shape[:-1]
    if activation != "id":
        if act_input is None:
            _fail(op, "act_input", f"given for activation {activation!r}", None)
        _check_operand(op, "act_input", act_input, (1,), like=("grad_output", grad_output))
        if act_input.shape != (*batch_shape, K):
            _fail(op, "act_input", f"of shape {(*batch_shape, K)}", f"{tuple(act_input.shape)}")
        act_input = act_input.reshape(-1, K).contiguous()
    grad2d = grad_output.reshape(-1, N)
    grad_input = torch.empty(grad2d.shape[0], K, device=grad_output.device,
                             dtype=grad_output.dtype)
    _launch(grad_input, act_input, grad2d, weight, None, weight.stride(0), weight.stride(1),
            activation, False, activation != "id", op, "grad_output")
    return grad_input.view(*batch_shape, K)


# ----------------------------------------------------------------------------------------------
# References in plain PyTorch.
# ----------------------------------------------------------------------------------------------


def linear_act_ref(x, weight, bias=None, activation="id", save_act_input=False):
    """triton_linear_act in PyTorch, computed in the inputs' dtype."""
    act_input = F.linear(x, weight, bias)
    out = activation_ref(act_input, activation)
    return (out, act_input) if save_act_input else out


def dgrad_act_ref(grad_output, weight, activation="id", act_input=None):
    """triton_dgrad_act in PyTorch, computed in the inputs' dtype."""
    grad = grad_output @ weight
    return grad if activation == "id" else grad * activation_grad_ref(act_input, activation)
