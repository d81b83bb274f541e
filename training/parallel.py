"""One process, or several started by torchrun (one node or many, through its rendezvous):
torch.distributed with gloo on CPU and NCCL on GPUs, the model wrapped in
DistributedDataParallel or sharded with FSDP2 (`fully_shard`, one unit per block)."""

import gc
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass
class Processes:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1

    def mean(self, tensor):
        """The mean of a scalar tensor over the processes, as a float."""
        if self.distributed:
            tensor = tensor.detach().clone()
            dist.all_reduce(tensor)  # gloo has no AVG
            tensor /= self.world_size
        return float(tensor)

    def gather(self, obj):
        """[each process's obj], rank order."""
        if not self.distributed:
            return [obj]
        objects = [None] * self.world_size
        dist.all_gather_object(objects, obj)
        return objects

    def barrier(self):
        if self.distributed:
            dist.barrier()


def launch_rank():
    """This process's rank as torchrun set it (0 without torchrun); readable before start()."""
    return int(os.environ.get("RANK", "0"))


def start(device):
    """Join torchrun's process group if there is one; the device this process trains on."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = launch_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank if device.index is None else device.index)
        torch.cuda.set_device(device)
    if world_size > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return Processes(rank, world_size, device)


def stop():
    """Leave the process group, once nothing holds work of it: collected first (a model wrapped
    in DDP keeps the group alive through its reducer)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def wrap(model, processes, parallel):
    """The model to train: itself in one process, else DDP or FSDP2 over every process."""
    if not processes.distributed:
        return model
    device = processes.device
    if parallel == "ddp":
        device_ids = [device] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (processes.world_size,))
    for block in model.transformer.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the rest: embeddings, final norm, the (tied) head
    return model


def unwrap(model):
    """The GPTLMHeadModel inside a DDP wrapper (FSDP2 shards the model in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model):
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def gradient_sync(model, enabled):
    """Forward and backward of a micro-batch: gradients are reduced over the processes only
    when enabled (the last micro-batch of a step)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)
        context = nullcontext()
    elif isinstance(model, DistributedDataParallel) and not enabled:
        context = model.no_sync()
    else:
        context = nullcontext()
    with context:
        yield
