"""training/checkpoint.py: atomic writes, finding the latest checkpoint, pruning, and the state
of a model and optimizer saved and loaded back."""

import pytest
import torch

from training import checkpoint


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "checkpoints" / "step_0000001.pt"
    checkpoint.save(path, {"step": 1})

    def fail_half_way(f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint.write_atomic(path, fail_half_way)
    assert checkpoint.read(path)["step"] == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_latest_ignores_temporaries_and_prune_keeps_the_newest(tmp_path):
    assert checkpoint.latest_checkpoint(tmp_path) is None
    for step in (5, 20, 10):
        checkpoint.save(checkpoint.checkpoint_path(tmp_path, step), {"step": step})
    leftover = checkpoint.checkpoint_dir(tmp_path) / ".step_0000030.pt.tmp-123"
    leftover.write_bytes(b"killed mid-write")
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_0000020.pt"
    checkpoint.prune(tmp_path, keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [10, 20]
    assert not leftover.exists()


def test_read_rejects_other_files(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="not a checkpoint of this trainer"):
        checkpoint.read(path)


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_model_and_optimizer_state_round_trip(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    model_state, optimizer_state = checkpoint.gather_state(model, optimizer)
    assert set(optimizer_state["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    path = tmp_path / "step_0000001.pt"
    checkpoint.save(path, {"model": model_state, "optimizer": optimizer_state})
    payload = checkpoint.read(path)
    other, other_optimizer = _model_and_optimizer(1)
    checkpoint.load_state(other, other_optimizer, payload["model"], payload["optimizer"])
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[a][key], other_optimizer.state[b][key])


def test_rng_state_round_trip():
    device = torch.device("cpu")
    state = checkpoint.rng_state(device)
    expected = torch.rand(5)
    checkpoint.set_rng_state(state, device)
    assert torch.equal(torch.rand(5), expected)
