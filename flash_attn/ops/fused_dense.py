"""Dense layers on fused cuBLASLt GEMMs (fused_dense_lib), with tensor and sequence parallelism.

Paths a call can take:
- fused: CUDA fp16/bf16 inputs (or fp32 under CUDA autocast) with the extension built. FusedDense
  runs its forward on F.linear and gets the bias gradient from the weight-gradient GEMM's BGRADB
  epilogue (in CUDA graphs on sm90 and up from flash_attn.ops.triton.bias_grad instead, see
  _bias_grad_apart);
  FusedMLP also fuses bias + activation into the first GEMM's epilogue (saving the
  pre-activation, GELU_AUX_BIAS / RELU_AUX_BIAS) and the activation's gradient into the second
  GEMM's input gradient (DGELU / DRELU; the first layer's bias gradient comes from its weight
  gradient's BGRADB epilogue) (`heuristic` >= 0). Under autocast on fp32 parameters the
  weight-gradient GEMM writes fp32 weight and bias gradients itself (no cast kernel after it).
- plain: anything else (CPU, fp32 without autocast, sizes the epilogues cannot take, extension
  missing) runs exactly the nn.Linear / F.gelu / F.relu computation of a plain PyTorch MLP. With a
  process_group it runs the same autograd Functions on PyTorch ops, so tensor parallelism also
  works on CPU (gloo).

heuristic: -1 = GEMM and activation as separate kernels; 0..4 = that candidate of cuBLASLt's
heuristic; "auto" = measured once per problem and cached (flash_attn.ops.fused_dense_autotune).

Both autograd Functions end their backward with the same steps (_linear_grads: the input
gradient, reduced over the process group, and the weight and bias gradients). What a call can
take (eligibility, the fused weight-gradient GEMM) is decided once, in the forward.
"""

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from flash_attn._native import extension_available, load_extension
from flash_attn.ops import fused_dense_autotune
from flash_attn.ops.activations import gelu_bwd, gelu_fwd, relu_bwd, sqrelu_bwd, sqrelu_fwd
from flash_attn.utils.autocast import compute_dtype
from flash_attn.utils.distributed import (
    all_gather_raw,
    all_reduce,
    all_reduce_raw,
    get_dim_for_local_rank,
    reduce_scatter,
    reduce_scatter_raw,
)

ACTIVATIONS = ("gelu_approx", "relu", "sqrelu")
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Largest row count / feature size run on the fused GEMMs (flash-attn's bound); beyond it, plain.
_MAX_FUSED_DIM = 65535 * 32
# cuBLASLt's leading-dimension rule for the saved activation input: GELU input in elements, ReLU
# bit-mask in bits.
_AUX_MULTIPLE = {"gelu_approx": 8, "relu": 128}
# The "auto" plans, by problem (the dict itself lives with the autotuner; benchmarks read it here).
_AUTO_PLANS = fused_dense_autotune.AUTO_PLANS


@functools.lru_cache(maxsize=None)
def _ext():
    """The fused_dense_lib module, or None when it is not built."""
    return load_extension("fused_dense_lib") if extension_available("fused_dense_lib") else None


def _on_one_cuda_device(*tensors):
    tensors = [t for t in tensors if t is not None]
    return all(t.is_cuda and t.device == tensors[0].device for t in tensors)


def _autocast_dtype(x):
    """The dtype the layers compute in: the autocast dtype of x's device when autocast is on."""
    return compute_dtype(x.device.type, x.dtype)


def _capturing(t):
    """Whether a CUDA graph is capturing t's work: there only the GPU's time counts. Outside one,
    a Triton launch's host time (tens of microseconds) can cost an eager step more than the
    kernel saves: FusedMLP at 8192 x 1024 -> 4096 fell from 1.1x to 0.7x the plain MLP in the
    benchmark's host-timed step with bias_grad in eager mode (session thirteenth). False while
    torch.compile traces (which fuses casts and sums itself)."""
    return t.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing()


def _cast(dtype, *tensors):
    """The tensors (None kept) in dtype: a layer's parameters under autocast. Two or more CUDA
    tensors of one dtype go through one kernel while a CUDA graph captures
    (flash_attn.ops.triton.cast: one node per layer instead of one per parameter); elsewhere
    torch's casts, which cost the host less."""
    present = [t for t in tensors if t is not None]
    if (len(present) > 1 and all(t.is_cuda and t.is_contiguous() and t.dtype == present[0].dtype
                                 and t.device == present[0].device for t in present)
            and present[0].dtype != dtype and _capturing(present[0])):
        from flash_attn.ops.triton.cast import cast_tensors

        casts = iter(cast_tensors(dtype, present))
        return [t if t is None else next(casts) for t in tensors]
    return [t if t is None else t.to(dtype) for t in tensors]


# The per-call paths below skip no-op reshapes and casts: each still costs a dispatcher call, which
# on the H200 machine's host takes about as long as launching a small kernel.


def _as_rows(t, rows):
    """t (..., features) as (rows, features)."""
    return t if t.dim() == 2 else t.reshape(rows, t.shape[-1])


def _as_batch(t, batch_shape):
    """t (rows, features) as (*batch_shape, features)."""
    return t if len(batch_shape) == 1 else t.reshape(*batch_shape, t.shape[-1])


def _to_dtype(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)


def _dense_eligible(x, weight, *more):
    """The fused kernels can take these inputs (device, dtype, sizes, extension)."""
    if _ext() is None or not _on_one_cuda_device(x, weight, *more):
        return False
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        if torch.get_autocast_dtype(device_type) not in _HALF_DTYPES:
            return False
    elif x.dtype not in _HALF_DTYPES:
        return False
    elif any(t is not None and t.dtype != x.dtype for t in (weight, *more)):
        return False  # mixed dtypes without autocast: let F.linear report it
    batch_dim = x.numel() // x.shape[-1] if x.dim() > 0 and x.shape[-1] > 0 else 0
    return _sizes_ok(batch_dim, [size for t in (weight, *more) if t is not None for size in t.shape])


def _sizes_ok(rows, features):
    # As PyTorch does for its own cuBLASLt epilogues: no dimension of 1 (GEMV shapes); and feature
    # rows of whole 16-byte vectors, which every cuBLASLt kernel takes.
    return (rows > 1 and all(size > 1 and size % 8 == 0 for size in features)
            and max(rows, *features) <= _MAX_FUSED_DIM)


# ---------------------------------------------------------------------------------------------
# The steps both Functions share


def _record_autocast(ctx):
    """What custom_fwd(device_type="cuda") records: the forward's CUDA autocast state."""
    ctx.autocast_state = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


def _backward_under_forward_autocast(backward):
    """custom_bwd(device_type="cuda")'s guarantee, the backward runs under the forward's autocast
    state (_record_autocast), entering an autocast context only when the current state differs.
    custom_bwd enters one on every call, the largest fixed cost of these backwards."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        enabled, dtype = ctx.autocast_state
        if torch.is_autocast_enabled("cuda") == enabled and (
                not enabled or torch.get_autocast_dtype("cuda") == dtype):
            return backward(ctx, *grads)
        with torch.autocast("cuda", enabled=enabled, dtype=dtype):
            return backward(ctx, *grads)

    return wrapper


def _gather_rows(x, process_group, sequence_parallel):
    """(total_x, handle): every rank's rows of x, all-gathered asynchronously (sequence
    parallelism), or x itself and None."""
    if process_group is not None and sequence_parallel:
        return all_gather_raw(x, process_group, async_op=True)
    return x, None


def _wgrad_fusable(x, rows, *layer_sizes):
    """For each (in_features, out_features) of layer_sizes: whether the fused weight-gradient GEMM
    takes a (rows, in_features) input with x's device and dtype and a (rows, out_features) output
    gradient. Decided in the forward, once, for the backward."""
    takes_x = _ext() is not None and _on_one_cuda_device(x) and x.dtype in _HALF_DTYPES
    return [takes_x and _sizes_ok(rows, sizes) for sizes in layer_sizes]


def _fp32_grads(x, weight, bias):
    """Whether the fused weight gradient comes out in fp32: the layer computes in half precision
    (x, already cast) on fp32 parameters, the autocast case, whose gradients autograd would
    otherwise cast to fp32 in a kernel of its own after the GEMM."""
    return (x.dtype in _HALF_DTYPES and weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32))


def _bias_grad_apart(grad_output):
    """Whether the fused weight gradient leaves the bias gradient to Triton's bias_grad: while a
    CUDA graph captures (_capturing) on sm90 and up, where cuBLASLt runs the BGRADB epilogue as
    a kernel of its own after the GEMM, at 1.4-2 TB/s on the H200 (1.76 ms of GPT-2 medium's
    step); bias_grad sums the same bytes at up to 3.3 TB/s. Elsewhere the epilogue stays."""
    return _capturing(grad_output) and torch.cuda.get_device_capability(grad_output.device)[0] >= 9


def _wgrad(input, grad_output, need_bias, fused, fp32_grads=False):
    """(grad_weight, grad_bias or None) of a Linear from 2-D input and grad_output; fused: one
    cuBLASLt GEMM with the bias gradient in its epilogue (see _wgrad_fusable) or from bias_grad
    (_bias_grad_apart), writing fp32 gradients with fp32_grads (_fp32_grads), else PyTorch's mm
    and sum."""
    if fused:
        grad_output = _to_dtype(grad_output, input.dtype).contiguous()
        if need_bias and _bias_grad_apart(grad_output):
            from flash_attn.ops.triton.bias_grad import bias_grad

            grad_weight = _ext().linear_bias_wgrad(input.contiguous(), grad_output, False, fp32_grads)[0]
            return grad_weight, bias_grad(grad_output, torch.float32 if fp32_grads else grad_output.dtype)
        return tuple(_ext().linear_bias_wgrad(input.contiguous(), grad_output, need_bias, fp32_grads))
    grad_weight = grad_output.t().mm(_to_dtype(input, grad_output.dtype))
    return grad_weight, (grad_output.sum(0) if need_bias else None)


def _weight_grads(input, grad_output, need_weight, need_bias, fused, fp32_grads=False):
    """(grad_weight, grad_bias) of a Linear from its 2-D input and output gradient, None where not
    needed: both from one GEMM (_wgrad), or the bias's sum alone."""
    if need_weight:
        return _wgrad(input, grad_output, need_bias, fused, fp32_grads)
    return None, (grad_output.sum(0) if need_bias else None)


def _linear_grads(grad_output, weight, total_x, handle_x, needs_input_grad, fused_wgrad,
                  residual_grad, process_group, sequence_parallel, batch_shape, fp32_grads=False):
    """(grad_input, grad_weight, grad_bias) of y = x W^T + b for 2-D grad_output (rows, out).

    The input gradient, plus residual_grad when the layer also returned its input, is reshaped to
    (*batch_shape, in) and reduced over process_group (reduce-scatter with sequence_parallel, else
    all-reduce) while the weight gradient runs; with a process group the residual's gradient,
    already local, is added after the reduction. total_x: the layer's input, still being gathered
    while handle_x is not None. fp32_grads: see _wgrad."""
    need_input, need_weight, need_bias = needs_input_grad
    rows = grad_output.shape[0]
    grad_input = handle_grad_input = None
    if need_input:
        if residual_grad is not None and process_group is None:
            residual = _to_dtype(_as_rows(residual_grad, rows), grad_output.dtype)
            grad_input = torch.addmm(residual, grad_output, weight)
        else:
            grad_input = grad_output.mm(weight)
        grad_input = _as_batch(grad_input, batch_shape)
        if process_group is not None:
            reduce_fn = reduce_scatter_raw if sequence_parallel else all_reduce_raw
            grad_input, handle_grad_input = reduce_fn(grad_input, process_group, async_op=True)
    if need_weight:
        if handle_x is not None:
            handle_x.wait()
            handle_x = None
        total_x = _as_rows(total_x, rows)
    grad_weight, grad_bias = _weight_grads(total_x, grad_output, need_weight, need_bias, fused_wgrad,
                                           fp32_grads)
    if handle_x is not None:
        handle_x.wait()
    if handle_grad_input is not None:
        handle_grad_input.wait()
        if residual_grad is not None:
            grad_input = grad_input + residual_grad
    return grad_input, grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------
# Linear


class FusedDenseFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, return_residual=False, process_group=None, sequence_parallel=True):
        """x (..., in_features); with a process_group and sequence_parallel, x is this rank's shard
        of dim 0 and is all-gathered first."""
        _record_autocast(ctx)
        ctx.compute_weight_gradient = weight.requires_grad
        ctx.return_residual = return_residual
        ctx.process_group = process_group
        ctx.sequence_parallel = process_group is not None and sequence_parallel
        autocast = torch.is_autocast_enabled(x.device.type)
        if autocast:
            x = x.to(_autocast_dtype(x))
        x = x.contiguous()
        total_x, handle_x = _gather_rows(x, process_group, sequence_parallel)
        ctx.fp32_grads = _fp32_grads(x, weight, bias)
        if autocast:  # cast while the gather is in flight
            weight, bias = _cast(x.dtype, weight, bias)
        if handle_x is not None:
            handle_x.wait()
        output = F.linear(total_x, weight, bias)
        ctx.fused_wgrad = ctx.compute_weight_gradient and _wgrad_fusable(
            x, total_x.shape[:-1].numel(), weight.shape[::-1])[0]
        # Only the local shard is kept; backward gathers it again (memory over communication).
        ctx.save_for_backward(x if ctx.compute_weight_gradient else None, weight)
        return output if not return_residual else (output, x)

    @staticmethod
    @_backward_under_forward_autocast
    def backward(ctx, grad_output, *args):
        grad_output = grad_output.contiguous()
        x, weight = ctx.saved_tensors
        total_x, handle_x = (None, None) if x is None else _gather_rows(
            x, ctx.process_group, ctx.sequence_parallel)
        batch_shape = grad_output.shape[:-1]
        grad_output = _as_rows(grad_output, batch_shape.numel())
        grads = _linear_grads(grad_output, weight, total_x, handle_x, ctx.needs_input_grad[:3],
                              ctx.fused_wgrad, args[0] if ctx.return_residual else None,
                              ctx.process_group, ctx.sequence_parallel, batch_shape, ctx.fp32_grads)
        return (*grads, None, None, None)


def fused_dense_func(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, return_residual: bool = False,
                     process_group: Optional[ProcessGroup] = None, sequence_parallel: bool = True):
    """F.linear(x, weight, bias) with the fused backward where eligible; with return_residual,
    (output, x). With a process_group: all-gather x first (sequence_parallel) and reduce the input
    gradient (reduce-scatter, or all-reduce without sequence parallelism)."""
    if process_group is not None or _dense_eligible(x, weight, bias):
        return FusedDenseFunc.apply(x, weight, bias, return_residual, process_group, sequence_parallel)
    out = F.linear(x, weight, bias)
    return out if not return_residual else (out, x)


class FusedDense(nn.Linear):
    """nn.Linear drop-in; forward(x, process_group=None) as fused_dense_func."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, return_residual: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.return_residual = return_residual

    def forward(self, x, process_group=None):
        return fused_dense_func(x, self.weight, self.bias, return_residual=self.return_residual,
                                process_group=process_group)


class ColumnParallelLinear(nn.Linear):
    """This rank's rows of a Linear's weight (output features, split in units of multiple_of; the
    first ranks get one unit more when it does not divide). Input: this rank's sequence shard
    (sequence_parallel, gathered here) or the full input; output: this rank's features."""

    def __init__(self, in_features: int, out_features: int, process_group: ProcessGroup, bias: bool = True,
                 sequence_parallel=True, multiple_of=1, device=None, dtype=None) -> None:
        if out_features % multiple_of:
            raise ValueError(f"out_features ({out_features}) must be a multiple of {multiple_of}")
        world_size = torch.distributed.get_world_size(process_group)
        rank = torch.distributed.get_rank(process_group)
        local = get_dim_for_local_rank(out_features, world_size, rank, multiple_of)
        super().__init__(in_features, local, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        return fused_dense_func(x, self.weight, self.bias, process_group=self.process_group,
                                sequence_parallel=self.sequence_parallel)


class RowParallelLinear(nn.Linear):
    """This rank's columns of a Linear's weight (input features); the partial outputs are summed
    by reduce-scatter (sequence_parallel) or all-reduce. Only rank 0 holds the bias."""

    def __init__(self, in_features: int, out_features: int, process_group: ProcessGroup, bias: bool = True,
                 sequence_parallel=True, multiple_of=1, device=None, dtype=None) -> None:
        if in_features % multiple_of:
            raise ValueError(f"in_features ({in_features}) must be a multiple of {multiple_of}")
        world_size = torch.distributed.get_world_size(process_group)
        rank = torch.distributed.get_rank(process_group)
        local = get_dim_for_local_rank(in_features, world_size, rank, multiple_of)
        super().__init__(local, out_features, bias=bias and rank == 0, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        out = fused_dense_func(x, self.weight, self.bias)
        reduce_fn = reduce_scatter if self.sequence_parallel else all_reduce
        return reduce_fn(out, self.process_group)


# ---------------------------------------------------------------------------------------------
# MLP: Linear -> activation -> Linear


def _split_heuristic(heuristic, activation):
    """(forward, backward, wgrad) choice from an int (forward and backward; wgrad 0) or a pair or
    triple. forward/backward: -1 unfused, else the cuBLASLt candidate of the GEMM + activation
    epilogue; wgrad: 0 the BGRADB GEMM of fused_dense_lib, -1 PyTorch's mm + sum."""
    if isinstance(heuristic, (tuple, list)):
        fwd, bwd, wgrad = (tuple(heuristic) + (0,))[:3]
    else:
        fwd = bwd = heuristic
        wgrad = 0
    fwd, bwd, wgrad = int(fwd), int(bwd), int(wgrad)
    if activation == "sqrelu" and (fwd, bwd) != (-1, -1):
        raise ValueError(f"activation='sqrelu' has no cuBLASLt epilogue: heuristic must be -1 (got {heuristic})")
    if activation == "relu" and fwd < 0:
        bwd = -1  # the fused ReLU backward reads the bit-mask only the fused forward writes
    return fwd, bwd, wgrad


def _act_forward(x, weight1, bias1, activation, heuristic, save_act_input):
    """(output1, act_input) for 2-D x. act_input is what the activation's backward reads: the
    pre-activation (GELU, squared ReLU), the bit-mask (fused ReLU) or None (unfused ReLU, whose
    backward reads output1); None too when save_act_input is False."""
    if heuristic >= 0:
        out = _ext().linear_act_forward(x, weight1, bias1, activation == "gelu_approx", save_act_input, heuristic)
        return out[0], (out[1] if save_act_input else None)
    pre_act = F.linear(x, weight1, bias1)
    if activation == "relu":
        return pre_act.relu_(), None  # in place: the pre-activation is not needed again
    output1 = gelu_fwd(pre_act) if activation == "gelu_approx" else sqrelu_fwd(pre_act)
    return output1, (pre_act if save_act_input else None)


def _act_backward(grad_output, weight2, act_input, output1, activation, heuristic):
    """The gradient of the pre-activation, for 2-D grad_output. Fused (heuristic >= 0): the second
    layer's input-gradient GEMM with the DGELU / DRELU epilogue. Not its _BGRAD variant: on H100 /
    H200 the bias-gradient reduction over the batch makes that GEMM 2.5-3.5x slower (bf16 MLP shapes
    of GPT-2 and Llama), while the first layer's weight-gradient GEMM gets the same sum almost
    free from its BGRADB epilogue, which reads this same matrix."""
    if heuristic >= 0:
        return _ext().act_linear_dgrad(weight2, grad_output, act_input, activation == "gelu_approx", heuristic)
    grad_output1 = grad_output.mm(weight2)
    if activation == "gelu_approx":
        return gelu_bwd(grad_output1, act_input)
    if activation == "sqrelu":
        return sqrelu_bwd(grad_output1, act_input)
    return relu_bwd(grad_output1, output1)


class FusedMLPFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight1, bias1, weight2, bias2, activation="gelu_approx", save_pre_act=True,
                return_residual=False, checkpoint_lvl=0, heuristic=0, process_group=None, sequence_parallel=True):
        """checkpoint_lvl: 0 keeps the activation's input and output for backward, 1 recomputes the
        output, 2 recomputes both (save_pre_act=False implies 2). heuristic: int or a (forward,
        backward[, wgrad]) tuple, see _split_heuristic."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS} (got {activation!r})")
        if checkpoint_lvl not in (0, 1, 2):
            raise ValueError(f"checkpoint_lvl must be 0, 1 or 2 (got {checkpoint_lvl})")
        _record_autocast(ctx)
        fwd_h, bwd_h, wgrad_h = _split_heuristic(heuristic, activation)
        if not save_pre_act:
            checkpoint_lvl = 2
        autocast = torch.is_autocast_enabled(x.device.type)
        if autocast:
            x = x.to(_autocast_dtype(x))
        x = x.contiguous()
        sequence_parallel = process_group is not None and sequence_parallel
        total_x, handle_x = _gather_rows(x, process_group, sequence_parallel)
        ctx.fp32_grads = (_fp32_grads(x, weight1, bias1), _fp32_grads(x, weight2, bias2))
        if autocast:  # cast while the gather is in flight
            weight1, bias1, weight2, bias2 = _cast(x.dtype, weight1, bias1, weight2, bias2)
        weight1, weight2 = weight1.contiguous(), weight2.contiguous()
        if handle_x is not None:
            handle_x.wait()
        batch_shape = total_x.shape[:-1]
        batch_dim = batch_shape.numel()
        # ReLU's unfused backward reads output1; only its fused backward needs the bit-mask.
        need_act_input = activation != "relu" or bwd_h >= 0
        output1, act_input = _act_forward(_as_rows(total_x, batch_dim), weight1, bias1, activation, fwd_h,
                                          need_act_input and checkpoint_lvl < 2)
        output2 = F.linear(output1, weight2, bias2)
        if checkpoint_lvl == 0 or (checkpoint_lvl == 1 and activation == "relu"):
            ctx.save_for_backward(x, weight1, weight2, act_input, output1)  # ReLU: output1 cannot be recomputed
        elif checkpoint_lvl == 1:
            ctx.save_for_backward(x, weight1, weight2, act_input)
        else:
            ctx.save_for_backward(x, weight1, weight2, bias1)
        ctx.fused_wgrad1, ctx.fused_wgrad2 = (
            _wgrad_fusable(x, batch_dim, weight1.shape[::-1], weight2.shape[::-1]) if wgrad_h >= 0
            else (False, False))
        ctx.activation, ctx.checkpoint_lvl, ctx.heuristic = activation, checkpoint_lvl, (fwd_h, bwd_h)
        ctx.need_act_input, ctx.return_residual = need_act_input, return_residual
        ctx.process_group, ctx.sequence_parallel = process_group, sequence_parallel
        output2 = _as_batch(output2, batch_shape)
        return output2 if not return_residual else (output2, x)

    @staticmethod
    @_backward_under_forward_autocast
    def backward(ctx, grad_output, *args):
        grad_output = grad_output.contiguous()
        activation, (fwd_h, bwd_h) = ctx.activation, ctx.heuristic
        process_group, sequence_parallel = ctx.process_group, ctx.sequence_parallel
        x, weight1, weight2, *rest = ctx.saved_tensors
        total_x, handle_x = _gather_rows(x, process_group, sequence_parallel)
        batch_shape = grad_output.shape[:-1]
        batch_dim = batch_shape.numel()
        if ctx.checkpoint_lvl == 0 or (ctx.checkpoint_lvl == 1 and activation == "relu"):
            act_input, output1 = rest
        elif ctx.checkpoint_lvl == 1:
            (act_input,) = rest
            output1 = gelu_fwd(act_input) if activation == "gelu_approx" else sqrelu_fwd(act_input)
        else:
            (bias1,) = rest
            if handle_x is not None:
                handle_x.wait()
                handle_x = None
            output1, act_input = _act_forward(_as_rows(total_x, batch_dim), weight1, bias1, activation, fwd_h,
                                              ctx.need_act_input)
        grad_output = _as_rows(grad_output, batch_dim)
        grad_weight2, grad_bias2 = _weight_grads(output1, grad_output, ctx.needs_input_grad[3],
                                                 ctx.needs_input_grad[4], ctx.fused_wgrad2, ctx.fp32_grads[1])
        grad_pre_act = _act_backward(grad_output, weight2, act_input, output1, activation, bwd_h)
        del output1, act_input
        # bias1's gradient comes with weight1's (the BGRADB epilogue), from grad_pre_act.
        grad_input, grad_weight1, grad_bias1 = _linear_grads(
            grad_pre_act, weight1, total_x, handle_x, ctx.needs_input_grad[:3], ctx.fused_wgrad1,
            args[0] if ctx.return_residual else None, process_group, sequence_parallel, batch_shape,
            ctx.fp32_grads[0])
        return (grad_input, grad_weight1, grad_bias1, grad_weight2, grad_bias2) + (None,) * 7


def _mlp_eligible(x, weight1, weight2, bias1, bias2, activation):
    if not _dense_eligible(x, weight1, weight2, bias1, bias2):
        return False
    hidden = weight1.shape[0]
    return activation == "sqrelu" or hidden % _AUX_MULTIPLE[activation] == 0


def fused_mlp_func(x: Tensor, weight1: Tensor, weight2: Tensor, bias1: Optional[Tensor] = None,
                   bias2: Optional[Tensor] = None, activation: str = "gelu_approx", save_pre_act: bool = True,
                   return_residual: bool = False, checkpoint_lvl: int = 0, heuristic=0,
                   process_group: Optional[ProcessGroup] = None, sequence_parallel: bool = True):
    """F.linear(act(F.linear(x, weight1, bias1)), weight2, bias2) with act gelu_approx (tanh),
    relu or sqrelu; with return_residual, (output, x). heuristic: -1, 0..4, "auto", or a (forward,
    backward[, wgrad]) tuple as "auto" chooses it. With a process_group, weight1/bias1 hold this
    rank's hidden features and weight2 its columns: x is all-gathered first (sequence_parallel)
    and the output is this rank's partial sum, to be reduced by the caller."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS} (got {activation!r})")
    if checkpoint_lvl not in (0, 1, 2):
        raise ValueError(f"checkpoint_lvl must be 0, 1 or 2 (got {checkpoint_lvl})")
    if _mlp_eligible(x, weight1, weight2, bias1, bias2, activation):
        if heuristic == "auto":
            heuristic = fused_dense_autotune.plan_for(x, weight1, weight2, bias1, bias2, _autocast_dtype(x),
                                                      activation, save_pre_act, process_group,
                                                      sequence_parallel)
    elif process_group is not None:
        heuristic = -1  # the same Functions on PyTorch ops, for their communication
    else:
        pre_act = F.linear(x, weight1, bias1)
        if activation == "gelu_approx":
            output1 = F.gelu(pre_act, approximate="tanh")
        else:
            output1 = F.relu(pre_act) if activation == "relu" else sqrelu_fwd(pre_act)
        out = F.linear(output1, weight2, bias2)
        return out if not return_residual else (out, x)
    return FusedMLPFunc.apply(x, weight1, bias1, weight2, bias2, activation, save_pre_act, return_residual,
                              checkpoint_lvl, heuristic, process_group, sequence_parallel)


class FusedMLP(nn.Module):
    """fc1 -> activation -> fc2, as fused_mlp_func. hidden_features defaults to 4 * in_features,
    out_features to in_features. In eval mode the activation's input is not saved (checkpoint_lvl
    2 if a backward is run anyway)."""

    def __init__(self, in_features, hidden_features=None, out_features=None, bias1=True, bias2=True,
                 activation="gelu_approx", return_residual=False, checkpoint_lvl=0, heuristic="auto",
                 device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS} (got {activation!r})")
        if checkpoint_lvl not in (0, 1, 2):
            raise ValueError(f"checkpoint_lvl must be 0, 1 or 2 (got {checkpoint_lvl})")
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features * 4
        self.activation = activation
        self.return_residual = return_residual
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic if activation != "sqrelu" else -1
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory_kwargs)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x, process_group=None):
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, save_pre_act=self.training,
                             return_residual=self.return_residual, checkpoint_lvl=self.checkpoint_lvl,
                             heuristic=self.heuristic, process_group=process_group)
        if self.return_residual:
            out, x = out
        if process_group is not None:
            out = reduce_scatter(out, process_group)
        return out if not self.return_residual else (out, x)


class ParallelFusedMLP(nn.Module):
    """FusedMLP split over process_group: fc1 a ColumnParallelLinear, fc2 a RowParallelLinear.
    Input: this rank's sequence shard (sequence_parallel) or the full input; output likewise,
    after a reduce-scatter (sequence_parallel) or an all-reduce of the partial sums."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation="gelu_approx",
                 process_group: ProcessGroup = None, bias1=True, bias2=True, sequence_parallel=True,
                 checkpoint_lvl=0, heuristic="auto", device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS} (got {activation!r})")
        if checkpoint_lvl not in (0, 1, 2):
            raise ValueError(f"checkpoint_lvl must be 0, 1 or 2 (got {checkpoint_lvl})")
        if process_group is None:
            raise ValueError("ParallelFusedMLP needs a process_group")
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features * 4
        self.activation = activation
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic if activation != "sqrelu" else -1
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1,
                                        sequence_parallel=sequence_parallel, **factory_kwargs)
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory_kwargs)

    def forward(self, x):
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, save_pre_act=self.training,
                             checkpoint_lvl=self.checkpoint_lvl, heuristic=self.heuristic,
                             process_group=self.process_group, sequence_parallel=self.sequence_parallel)
        reduce_fn = reduce_scatter if self.sequence_parallel else all_reduce
        return reduce_fn(out, self.process_group)
