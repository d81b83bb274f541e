"""Tensor- and sequence-parallel dense layers on two processes, against the single-process layer.

gloo on CPU (float64, so the sharded result must match the full layer to rounding), and NCCL on
two GPUs (bf16 on the fused paths: within twice the error, against the full fp32 layer, of the
same sharded computation run on plain PyTorch ops in bf16).

The ranks are started by flash_attn.utils.testing.run_distributed.
"""

import time

import pytest
import torch
import torch.distributed as dist

import flash_attn.ops.fused_dense as fd
from flash_attn.ops.fused_dense import (
    ColumnParallelLinear,
    FusedDense,
    FusedMLP,
    ParallelFusedMLP,
    RowParallelLinear,
)
from flash_attn.utils.distributed import get_dim_for_local_rank
from flash_attn.utils.testing import run_distributed

WORLD_SIZE = 2


def test_parallel_layers_gloo():
    for output in run_distributed(run_rank, WORLD_SIZE, "gloo", args=("gloo",)):
        assert sum(line.startswith("ok ") for line in output.splitlines()) == len(cases()), output


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_parallel_layers_nccl():
    for output in run_distributed(run_rank, WORLD_SIZE, "nccl", args=("nccl",), timeout=600):
        assert sum(line.startswith("ok ") for line in output.splitlines()) == len(cases()), output


# ----------------------------------------------------------------------------------------------
# What each rank runs


def shard(t, dim, rank, world, multiple_of=1):
    sizes = [get_dim_for_local_rank(t.shape[dim], world, r, multiple_of) for r in range(world)]
    return t.narrow(dim, sum(sizes[:rank]), sizes[rank])


def cases():
    """(name, builder kwargs). Feature sizes keep every shard eligible for the fused GPU paths."""
    out = []
    for sp in (True, False):
        out.append((f"column+row linear sp={sp}", dict(kind="linear", sequence_parallel=sp, multiple_of=1)))
        out.append((f"column+row linear uneven sp={sp}", dict(kind="linear", sequence_parallel=sp, multiple_of=64)))
        for activation in ("gelu_approx", "relu", "sqrelu"):
            for lvl in (0, 2):
                out.append((f"ParallelFusedMLP {activation} lvl={lvl} sp={sp}",
                            dict(kind="mlp", sequence_parallel=sp, activation=activation, checkpoint_lvl=lvl)))
    out.append(("FusedMLP with process_group, return_residual", dict(kind="mlp_residual", sequence_parallel=True)))
    out.append(("FusedDense with process_group, return_residual", dict(kind="dense_residual", sequence_parallel=True)))
    return out


def make_full(kind, activation="gelu_approx", **_):
    """The single-process layer and its data, in float64 on CPU, the same on every rank."""
    torch.manual_seed(0)
    in_f, hidden, out_f = 64, 320, 128  # 320 = 5 units of 64: the uneven split gives 192 / 128
    if kind in ("linear", "dense_residual"):
        full = torch.nn.Sequential(torch.nn.Linear(in_f, hidden), torch.nn.Linear(hidden, out_f)).double()
    else:
        hidden = 256  # each shard a multiple of 128, as the fused ReLU needs
        full = FusedMLP(in_f, hidden, out_f, activation=activation, dtype=torch.float64)
    x = torch.randn(4, 6, in_f, dtype=torch.float64)
    grad = torch.randn(4, 6, out_f if kind != "dense_residual" else hidden, dtype=torch.float64)
    grad_residual = torch.randn(4, 6, in_f, dtype=torch.float64)
    return full, x, grad, grad_residual


def full_results(kind, full, x, grad, grad_residual, device, dtype):
    """Outputs and gradients of the single-process layer (on device, in dtype)."""
    full = full.to(device=device, dtype=dtype)
    x = x.to(device=device, dtype=dtype).clone().requires_grad_()
    grad, grad_residual = grad.to(device=device, dtype=dtype), grad_residual.to(device=device, dtype=dtype)
    if kind == "dense_residual":
        out = full[0](x)
        (out * grad).sum().backward()
    else:
        out = full(x)
        loss = (out * grad).sum()
        if kind == "mlp_residual":
            loss = loss + (x * grad_residual).sum()
        loss.backward()
    first, second = (full[0], full[1]) if kind in ("linear", "dense_residual") else (full.fc1, full.fc2)
    return {"out": out.detach(), "x.grad": x.grad, "fc1.weight.grad": first.weight.grad,
            "fc1.bias.grad": first.bias.grad, "fc2.weight.grad": second.weight.grad,
            "fc2.bias.grad": second.bias.grad}


def sharded_results(kind, group, rank, world, device, dtype, sequence_parallel=True, multiple_of=1,
                    activation="gelu_approx", checkpoint_lvl=0):
    """The same through the parallel layers; returns results and the full-layer results mapped to
    this rank's shards."""
    full, x, grad, grad_residual = make_full(kind, activation)
    kw = dict(device=device, dtype=dtype)
    first_full = full[0] if kind in ("linear", "dense_residual") else full.fc1
    second_full = full[1] if kind in ("linear", "dense_residual") else full.fc2
    in_f, hidden, out_f = first_full.in_features, first_full.out_features, second_full.out_features
    if kind == "linear":
        first = ColumnParallelLinear(in_f, hidden, group, sequence_parallel=sequence_parallel,
                                     multiple_of=multiple_of, **kw)
        second = RowParallelLinear(hidden, out_f, group, sequence_parallel=sequence_parallel,
                                   multiple_of=multiple_of, **kw)
        model = torch.nn.Sequential(first, second)
    elif kind == "mlp":
        model = ParallelFusedMLP(in_f, hidden, out_f, activation=activation, process_group=group,
                                 sequence_parallel=sequence_parallel, checkpoint_lvl=checkpoint_lvl, **kw)
        first, second = model.fc1, model.fc2
    elif kind == "mlp_residual":  # a FusedMLP holding this rank's shards, reduced by FusedMLP.forward
        model = FusedMLP(in_f, get_dim_for_local_rank(hidden, world, rank), out_f, activation=activation,
                         return_residual=True, bias2=rank == 0, **kw)
        first, second = model.fc1, model.fc2
    else:  # dense_residual: the column-parallel half only
        first = FusedDense(in_f, get_dim_for_local_rank(hidden, world, rank), return_residual=True, **kw)
        second = None
    with torch.no_grad():
        first.weight.copy_(shard(first_full.weight, 0, rank, world, multiple_of))
        first.bias.copy_(shard(first_full.bias, 0, rank, world, multiple_of))
        if second is not None:
            second.weight.copy_(shard(second_full.weight, 1, rank, world, multiple_of))
            if second.bias is not None:
                second.bias.copy_(second_full.bias)
    ref = full_results(kind, full, x, grad, grad_residual, device, torch.float64 if dtype == torch.float64
                       else torch.float32)

    local = (lambda t: t.chunk(world)[rank]) if sequence_parallel else (lambda t: t)
    x_local = local(x).to(**kw).clone().requires_grad_()
    grad_local, grad_residual_local = local(grad).to(**kw), local(grad_residual).to(**kw)
    if kind == "mlp_residual":
        out, residual = model(x_local, process_group=group)
        assert residual.data_ptr() == x_local.data_ptr()
        torch.autograd.backward([out, residual], [grad_local, grad_residual_local])
    elif kind == "dense_residual":
        out, residual = first(x_local, process_group=group)
        assert residual.data_ptr() == x_local.data_ptr()
        torch.autograd.backward([out, residual], [shard(grad, 2, rank, world).to(**kw), grad_residual_local])
        ref["x.grad"] = ref["x.grad"] + grad_residual.to(ref["x.grad"])
    else:
        out = model(x_local)
        out.backward(grad_local)
    ours = {"out": out.detach(), "x.grad": x_local.grad, "fc1.weight.grad": first.weight.grad,
            "fc1.bias.grad": first.bias.grad}
    if second is not None:
        ours["fc2.weight.grad"] = second.weight.grad
        ours["fc2.bias.grad"] = second.bias.grad if second.bias is not None else None
    # The full layer's results, cut to what this rank holds.
    if kind == "dense_residual":
        ref["out"] = shard(ref["out"], 2, rank, world)  # all rows, this rank's features
    else:
        ref["out"] = local(ref["out"])
    ref["x.grad"] = local(ref["x.grad"])
    ref["fc1.weight.grad"] = shard(ref["fc1.weight.grad"], 0, rank, world, multiple_of)
    ref["fc1.bias.grad"] = shard(ref["fc1.bias.grad"], 0, rank, world, multiple_of)
    if second is None:
        del ref["fc2.weight.grad"], ref["fc2.bias.grad"]
    else:
        ref["fc2.weight.grad"] = shard(ref["fc2.weight.grad"], 1, rank, world, multiple_of)
        if second.bias is None:  # only rank 0 holds the row-parallel bias
            ref["fc2.bias.grad"] = None
    return ours, ref


def check_close(name, ours, ref):
    assert set(ours) == set(ref), (name, set(ours) ^ set(ref))
    for key in ours:
        assert (ours[key] is None) == (ref[key] is None), (name, key)
        if ours[key] is not None:
            torch.testing.assert_close(ours[key], ref[key], rtol=1e-9, atol=1e-9, msg=lambda m: f"{name} {key}: {m}")


def check_within_plain(name, ours, plain, ref):
    """GPU: |ours - fp32 full layer| <= 2 |plain PyTorch, same sharding and dtype - fp32 full| + slack."""
    for key in ours:
        if ours[key] is None:
            assert plain[key] is None, (name, key)
            continue
        err = (ours[key].float() - ref[key]).abs().max().item()
        base = (plain[key].float() - ref[key]).abs().max().item()
        bound = 2 * base + 1e-4 * (1 + ref[key].abs().max().item())
        assert err <= bound, f"{name} {key}: max error {err:.3g} > {bound:.3g} (plain PyTorch: {base:.3g})"


def run_rank(rank, world, backend):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    group = dist.new_group(list(range(world)))
    start = time.perf_counter()
    for name, kwargs in cases():
        if backend == "gloo":
            check_close(name, *sharded_results(group=group, rank=rank, world=world, device=device,
                                               dtype=torch.float64, **kwargs))
        else:
            ours, ref = sharded_results(group=group, rank=rank, world=world, device=device,
                                        dtype=torch.bfloat16, **kwargs)
            ext = fd._ext
            fd._ext = lambda: None  # plain PyTorch ops through the same Functions
            try:
                plain, _ = sharded_results(group=group, rank=rank, world=world, device=device,
                                           dtype=torch.bfloat16, **kwargs)
            finally:
                fd._ext = ext
            check_within_plain(name, ours, plain, ref)
        print(f"ok {name} {time.perf_counter() - start:.2f}s", flush=True)
