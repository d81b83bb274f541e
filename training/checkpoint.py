"""Checkpoints: one file per saved step, out/checkpoints/step_NNNNNNN.pt, holding the model,
optimizer, scheduler, step, data position, every process's RNG state, the model config and the
run's settings.

The model and optimizer are saved whole (torch.distributed.checkpoint.state_dict with
full_state_dict, keyed by parameter names), so a checkpoint written by one process, by DDP or by
FSDP resumes under any of them. Rank 0 writes it to a temporary file and renames it into place
(os.replace), so a run killed mid-write leaves the previous checkpoint as the latest. Every
process reads it back when resuming: --out must be on a file system every node sees.
"""

import json
import os
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

FORMAT = 1
_NAME = re.compile(r"step_(\d+)\.pt$")


def checkpoint_dir(out):
    return Path(out) / "checkpoints"


def checkpoint_path(out, step):
    return checkpoint_dir(out) / f"step_{step:07d}.pt"


def list_checkpoints(out):
    """[(step, path)] of the complete checkpoints in out, oldest first (temporary files of an
    interrupted write do not match)."""
    folder = checkpoint_dir(out)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(found)


def latest_checkpoint(out):
    found = list_checkpoints(out)
    return found[-1][1] if found else None


def _fsync_dir(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, write):
    """write(file object) into a temporary file beside path, then rename it to path: readers
    see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    _fsync_dir(path.parent)


def write_json(path, obj):
    write_atomic(path, lambda f: f.write(json.dumps(obj).encode()))


def gather_state(model, optimizer):
    """(model state, optimizer state), whole and on the CPU in rank 0 (empty elsewhere). Every
    process must call it (FSDP gathers the shards)."""
    return get_state_dict(model, optimizer,
                          options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_state(model, optimizer, model_state, optimizer_state):
    """The inverse of gather_state, on every process (FSDP keeps its own shard of each)."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def rng_state(device):
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save(path, payload):
    write_atomic(path, lambda f: torch.save(dict(payload, format=FORMAT), f))


def read(path):
    """A checkpoint's payload, tensors on the CPU (memory-mapped: read as they are used)."""
    payload = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{path}: not a checkpoint of this trainer (format "
                         f"{payload.get('format')!r}, expected {FORMAT})")
    return payload


def prune(out, keep):
    """Delete all but the newest `keep` checkpoints, and what a killed write left behind."""
    for _, path in list_checkpoints(out)[:-keep]:
        path.unlink(missing_ok=True)
    for path in checkpoint_dir(out).glob(".step_*.pt.tmp-*"):
        path.unlink(missing_ok=True)
