"""flash_attn.utils.distributed on two CPU processes (gloo).

The ranks are started by flash_attn.utils.testing.run_distributed.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from flash_attn.utils.distributed import (
    all_gather,
    all_gather_raw,
    all_reduce,
    all_reduce_raw,
    allreduce_sequence_parallel_grad,
    get_dim_for_local_rank,
    reduce_scatter,
    reduce_scatter_raw,
    sync_shared_params,
)
from flash_attn.utils.testing import run_distributed

WORLD_SIZE = 2


def test_get_dim_for_local_rank():
    assert [get_dim_for_local_rank(12, 4, r) for r in range(4)] == [3, 3, 3, 3]
    assert [get_dim_for_local_rank(10, 4, r) for r in range(4)] == [3, 3, 2, 2]
    # In units of multiple_of: 5 units of 8 over 2 ranks.
    assert [get_dim_for_local_rank(40, 2, r, multiple_of=8) for r in range(2)] == [24, 16]
    assert sum(get_dim_for_local_rank(4096, 3, r, multiple_of=64) for r in range(3)) == 4096


def test_collectives_on_two_processes():
    outputs = run_distributed(run_rank, WORLD_SIZE, "gloo")
    for output in outputs:
        assert sum(line.startswith("ok ") for line in output.splitlines()) == len(CHECKS), output


# ----------------------------------------------------------------------------------------------
# What each rank runs


def check_raw_collectives(rank, world, group):
    full = torch.arange(4 * 3, dtype=torch.float64).reshape(4, 3)
    local = full.chunk(world)[rank]
    for async_op in (False, True):
        out, handle = all_gather_raw(local, group, async_op=async_op)
        assert (handle is not None) == async_op
        if handle is not None:
            handle.wait()
        assert torch.equal(out, full)
        out, handle = reduce_scatter_raw(full * (rank + 1), group, async_op=async_op)
        if handle is not None:
            handle.wait()
        assert torch.equal(out, full.chunk(world)[rank] * sum(range(1, world + 1)))
        out, handle = all_reduce_raw(full.t() * (rank + 1), group, async_op=async_op)  # non-contiguous input
        if handle is not None:
            handle.wait()
        assert torch.equal(out, full.t() * sum(range(1, world + 1)))
    try:
        reduce_scatter_raw(torch.zeros(3, 2), group)
    except ValueError as error:
        assert "divisible" in str(error)
    else:
        raise AssertionError("reduce_scatter_raw accepted a dim 0 not divisible by the world size")


def check_autograd_collectives(rank, world, group):
    base = torch.randn(4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weight = base * (rank + 1)  # a different downstream gradient on each rank
    total = sum(range(1, world + 1))

    x = base.chunk(world)[rank].clone().requires_grad_()
    y = all_gather(x, group)
    assert torch.equal(y, base)
    (y * weight).sum().backward()
    assert torch.allclose(x.grad, base.chunk(world)[rank] * total)  # reduce-scattered gradient

    x = base.clone().requires_grad_()
    y = reduce_scatter(x * (rank + 1), group)
    assert torch.allclose(y, base.chunk(world)[rank] * total)
    (y * weight.chunk(world)[rank]).sum().backward()
    gathered_grad = torch.cat([base.chunk(world)[r] * (r + 1) for r in range(world)])  # every rank's grad of y
    assert torch.allclose(x.grad, gathered_grad * (rank + 1))

    x = base.clone().requires_grad_()
    y = all_reduce(x * (rank + 1), group)
    assert torch.allclose(y, base * total)
    (y * weight).sum().backward()
    assert torch.allclose(x.grad, weight * (rank + 1))  # passes straight through


def check_sync_shared_params(rank, world, group):
    torch.manual_seed(rank)  # different initial values on every rank
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight._shared_params = True
    model[1].bias._shared_params = True
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sync_shared_params(model, group)
    for name, p in model.named_parameters():
        gathered, _ = all_gather_raw(p.detach().unsqueeze(0), group)
        if name in ("0.weight", "1.bias"):
            assert all(torch.equal(gathered[r], gathered[0]) for r in range(world)), name
            if rank == 0:
                assert torch.equal(p, before[name])
        else:
            assert torch.equal(p, before[name]), name


def check_allreduce_sequence_parallel_grad(rank, world, group):
    model = nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 2))
    model[0].weight._sequence_parallel = True
    model[0].bias._sequence_parallel = True
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    allreduce_sequence_parallel_grad(model, group)
    total = float(sum(range(1, world + 1)))
    assert torch.equal(model[0].weight.grad, torch.full((3,), total))
    assert torch.equal(model[0].bias.grad, torch.full((3,), total))
    assert torch.equal(model[1].weight.grad, torch.full((2, 3), float(rank + 1)))  # not marked: untouched


CHECKS = [check_raw_collectives, check_autograd_collectives, check_sync_shared_params,
          check_allreduce_sequence_parallel_grad]


def run_rank(rank, world):
    group = dist.new_group(list(range(world)))
    for check in CHECKS:
        check(rank, world, group)
        print(f"ok {check.__name__}", flush=True)
