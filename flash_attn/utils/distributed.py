"""Collectives for tensor and sequence parallelism, and the helpers that keep parameters in sync.

The `*_raw` functions are plain (no autograd) and can run asynchronously: they return
(tensor, handle), handle being None unless async_op=True; wait on it before reading the tensor.
`all_gather`, `reduce_scatter` and `all_reduce` are autograd Functions whose backward is the
matching collective. Gathering and scattering work on the first dimension.
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

# Newer PyTorch renamed the single-tensor collectives; the old names warn there.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_raw(input_: Tensor, process_group: ProcessGroup, async_op: bool = False):
    """Concatenate every rank's input along dim 0: (world_size * n, ...)."""
    world_size = dist.get_world_size(process_group)
    output = torch.empty(world_size * input_.shape[0], *input_.shape[1:], dtype=input_.dtype,
                         device=input_.device)
    handle = _all_gather_single(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_: Tensor, process_group: ProcessGroup, async_op: bool = False):
    """Sum over ranks, then keep this rank's slice of dim 0: (n / world_size, ...)."""
    world_size = dist.get_world_size(process_group)
    if input_.shape[0] % world_size != 0:
        raise ValueError(f"reduce_scatter: dim 0 ({input_.shape[0]}) must be divisible by the world "
                         f"size ({world_size})")
    output = torch.empty(input_.shape[0] // world_size, *input_.shape[1:], dtype=input_.dtype,
                         device=input_.device)
    handle = _reduce_scatter_single(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def all_reduce_raw(input_: Tensor, process_group: ProcessGroup, async_op: bool = False):
    """Sum over ranks, in place on a contiguous version of the input (which is returned)."""
    input_ = input_.contiguous()
    handle = dist.all_reduce(input_, group=process_group, async_op=async_op)
    return input_, handle


class AllGatherFunc(torch.autograd.Function):
    """Gather the sequence-parallel shards; the gradient is reduce-scattered back."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        ctx.process_group = process_group
        output, _ = all_gather_raw(input_, process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_input, _ = reduce_scatter_raw(grad_output, ctx.process_group)
        return grad_input, None


all_gather = AllGatherFunc.apply


class ReduceScatterFunc(torch.autograd.Function):
    """Sum partial results and keep this rank's shard; the gradient is all-gathered."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        ctx.process_group = process_group
        output, _ = reduce_scatter_raw(input_, process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_input, _ = all_gather_raw(grad_output, ctx.process_group)
        return grad_input, None


reduce_scatter = ReduceScatterFunc.apply


class AllReduceFunc(torch.autograd.Function):
    """Sum partial results; every rank then holds the same output, so the gradient passes through."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        output, _ = all_reduce_raw(input_, process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return grad_output, None


all_reduce = AllReduceFunc.apply


def sync_shared_params(model: torch.nn.Module, process_group: ProcessGroup):
    """Broadcast from the group's first rank every parameter marked `_shared_params = True`
    (weights replicated across tensor-parallel ranks, such as tied embeddings)."""
    # Sorted by name so every rank visits the same parameters in the same order even when ranks
    # own different parameter sets (only rank 0 has RowParallelLinear's bias).
    shared = {name: p for name, p in model.named_parameters() if getattr(p, "_shared_params", False)}
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    with torch.no_grad():
        for _, p in sorted(shared.items()):
            dist.broadcast(p, src=src, group=process_group)


def allreduce_sequence_parallel_grad(model: torch.nn.Module, process_group: ProcessGroup):
    """Sum over ranks the gradients of parameters marked `_sequence_parallel = True` (replicated
    parameters, such as LayerNorm's, that each rank only saw its sequence shard through)."""
    params = {name: p for name, p in model.named_parameters() if getattr(p, "_sequence_parallel", False)}
    grads = [p.grad for _, p in sorted(params.items()) if p.grad is not None]
    if not grads:
        return
    with torch.no_grad():
        # One collective for all of them rather than one per parameter.
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=process_group)
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """This rank's share of `dim` split over world_size ranks in units of multiple_of; the first
    (dim / multiple_of) % world_size ranks get one unit more."""
    multiple = dim // multiple_of
    div, mod = divmod(multiple, world_size)
    return (div + int(local_rank < mod)) * multiple_of
