import json

import pytest
import torch
from safetensors.torch import save_file

from flash_attn.utils.pretrained import state_dict_from_pretrained


def _state_dict():
    torch.manual_seed(0)
    return {"a.weight": torch.randn(4, 3), "a.bias": torch.randn(4), "steps": torch.tensor([7])}


def _check(loaded, expected):
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_single_file_and_directory(tmp_path, fmt):
    sd = _state_dict()
    if fmt == "safetensors":
        path = tmp_path / "model.safetensors"
        save_file(sd, str(path))
    else:
        path = tmp_path / "pytorch_model.bin"
        torch.save(sd, path)
    _check(state_dict_from_pretrained(str(path)), sd)
    _check(state_dict_from_pretrained(tmp_path), sd)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded_with_index(tmp_path, fmt):
    sd = _state_dict()
    shards = {f"model-0000{i}-of-00002.{fmt}": part for i, part in
              enumerate(({"a.weight": sd["a.weight"]}, {"a.bias": sd["a.bias"], "steps": sd["steps"]}), 1)}
    weight_map = {}
    for name, part in shards.items():
        if fmt == "safetensors":
            save_file(part, str(tmp_path / name))
        else:
            torch.save(part, tmp_path / name)
        weight_map.update({k: name for k in part})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (tmp_path / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _check(state_dict_from_pretrained(tmp_path), sd)
    _check(state_dict_from_pretrained(tmp_path / index), sd)


def test_dtype_and_other_names(tmp_path):
    sd = _state_dict()
    torch.save(sd, tmp_path / "consolidated.pt")
    loaded = state_dict_from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded["a.weight"].dtype == torch.bfloat16 and loaded["steps"].dtype == torch.int64


def test_missing_checkpoint_raises_without_network(tmp_path):
    with pytest.raises(FileNotFoundError, match="no weights"):
        state_dict_from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no download"):
        state_dict_from_pretrained("no-such-org/no-such-model-anywhere")
