"""Loading checkpoints from local files: safetensors or torch (.bin / .pt), single files or
sharded with an index json, from a path, a directory, or a repo already in the Hugging Face cache.
Nothing here touches the network."""

import json
import os
from pathlib import Path

import torch

# Looked for in this order in a checkpoint directory.
WEIGHTS_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _from_hf_cache(model_name):
    """The local snapshot directory of a Hub repo that is already cached, or None."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_name, local_files_only=True)
    except Exception:  # not installed, not cached, or not a repo id
        return None


def resolve_weight_files(model_name):
    """The weight files a checkpoint name stands for (several when sharded)."""
    path = Path(model_name)
    if not path.exists():
        cached = _from_hf_cache(str(model_name))
        if cached is None:
            raise FileNotFoundError(
                f"state_dict_from_pretrained: {model_name!r} is neither a local file or "
                f"directory nor a repo in the Hugging Face cache (no download is attempted)")
        path = Path(cached)
    if path.is_dir():
        for name in WEIGHTS_NAMES:
            if (path / name).exists():
                path = path / name
                break
        else:
            found = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin")) or \
                sorted(path.glob("*.pt"))
            if not found:
                raise FileNotFoundError(f"state_dict_from_pretrained: no weights in {path} "
                                        f"(looked for {', '.join(WEIGHTS_NAMES)}, *.safetensors, "
                                        f"*.bin, *.pt)")
            return found
    if path.name.endswith(".index.json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        return [path.parent / name for name in sorted(set(weight_map.values()))]
    return [path]


def _load_file(path):
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(state_dict, dict) and "state_dict" in state_dict and len(state_dict) <= 3:
        state_dict = state_dict["state_dict"]  # training checkpoints wrap the weights
    return state_dict


def state_dict_from_pretrained(model_name, device=None, dtype=None):
    """All tensors of a checkpoint, merged over shards; floating tensors cast to dtype, all
    moved to device (they are read onto the CPU first)."""
    state_dict = {}
    for path in resolve_weight_files(os.fspath(model_name)):
        state_dict.update(_load_file(path))
    if dtype is not None:
        state_dict = {k: v.to(dtype=dtype) if v.is_floating_point() else v
                      for k, v in state_dict.items()}
    if device is not None:
        state_dict = {k: v.to(device=device) for k, v in state_dict.items()}
    return state_dict
