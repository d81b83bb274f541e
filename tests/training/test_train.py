"""training/train.py on CPU: a tiny run end to end, a run killed after a checkpoint and resumed
(the same losses as the uninterrupted run), options rejected before training starts, and the
schedule and optimizer groups."""

import math
import re
import shutil

import pytest
import torch

from training import checkpoint
from training.train import lr_factor, main, make_optimizer

STEPS = 60


def _args(tiny, corpus_dir, out):
    return tiny + ["--data", corpus_dir, "--out", out, "--steps", STEPS, "--batch-size", 4,
                   "--eval-every", 20, "--checkpoint-every", 10, "--keep-checkpoints", 3,
                   "--dropout", 0.1]  # dropout: resuming must restore the RNG state too


@pytest.fixture(scope="module")
def reference(tiny, corpus_dir, tmp_path_factory, run_train):
    """(out folder, output) of an uninterrupted tiny run."""
    out = tmp_path_factory.mktemp("reference") / "out"
    proc = run_train(_args(tiny, corpus_dir, out))
    return out, proc.stdout


def test_tiny_run_writes_checkpoints_plot_metrics_and_sample(reference, read_metrics):
    out, output = reference
    assert [step for step, _ in checkpoint.list_checkpoints(out)] == [40, 50, 60]  # keep 3
    payload = checkpoint.read(checkpoint.latest_checkpoint(out))
    assert payload["step"] == STEPS and payload["args"]["steps"] == STEPS
    assert set(payload) >= {"model", "optimizer", "scheduler", "data", "rng", "config", "args",
                            "history"}
    assert payload["data"]["index"] > 0 and len(payload["rng"]) == 1
    assert payload["scheduler"]["last_epoch"] == STEPS
    assert '"vocab_size": 256' in payload["config"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history = read_metrics(out)["history"]
    assert [row[0] for row in history["train"]] == list(range(1, STEPS + 1))
    assert [row[0] for row in history["val"]] == [0, 20, 40, 60]
    first, last = history["val"][0][1], history["val"][-1][1]
    assert first == pytest.approx(math.log(256), abs=0.3)  # an untrained model: ~uniform
    assert last < first - 1.0, history["val"]
    assert f"validation loss {first:.4f} (step 0) -> {last:.4f} (step 60)" in output
    prompt, generated = (out / "sample.txt").read_text().split(" >>> ", 1)
    assert prompt and generated


def test_killed_run_resumes_to_the_same_losses(reference, tiny, corpus_dir, tmp_path, run_train,
                                               start_train, read_metrics):
    out = tmp_path / "out"
    args = _args(tiny, corpus_dir, out)
    proc = start_train(args)
    for line in proc.stdout:  # SIGKILL as soon as the first checkpoint is in place
        if "checkpoint" in line and "step_0000010.pt" in line:
            proc.kill()
            break
    proc.stdout.close()
    assert proc.wait(timeout=60) == -9, "the run ended before it was killed"
    killed_at = checkpoint.list_checkpoints(out)[-1][0]
    assert 10 <= killed_at < STEPS
    resumed = run_train(args + ["--resume"])
    assert f"resuming at step {killed_at}" in resumed.stdout
    expected, got = read_metrics(reference[0])["history"], read_metrics(out)["history"]
    assert got["train"] == expected["train"]  # loss, lr and gradient norm of every step
    assert got["val"] == expected["val"]
    final = checkpoint.read(checkpoint.latest_checkpoint(out))["model"]
    reference_final = checkpoint.read(checkpoint.latest_checkpoint(reference[0]))["model"]
    assert all(torch.equal(final[k], reference_final[k]) for k in reference_final)


def test_resume_with_more_steps_follows_the_new_schedule(reference, tiny, corpus_dir, tmp_path,
                                                         run_train, read_metrics):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoint.latest_checkpoint(reference[0]), out / "checkpoints")
    run_train(_args(tiny, corpus_dir, out) + ["--resume", "--steps", 64, "--lr", 1e-3])
    train = read_metrics(out)["history"]["train"]
    assert train[:STEPS] == read_metrics(reference[0])["history"]["train"]
    assert [row[0] for row in train[STEPS:]] == [61, 62, 63, 64]
    for step, _, lr, _ in train[STEPS:]:
        assert lr == pytest.approx(1e-3 * lr_factor(step - 1, 2, 64, 0.1), rel=1e-12)


# ----------------------------------------------------------------------------------------------
# Rejected before training: exit status 2, a message naming the option, nothing written.


def _rejected(argv, capsys):
    status = main([str(a) for a in argv])
    assert status == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (["--n-embd", 100, "--n-head", 3], "n_embd 100 is not divisible by n_head 3"),
    (["--n-head", 4, "--n-head-kv", 3], "n_head 4 is not divisible by n_head_kv 3"),
    (["--seqlen", 10 ** 7], "fewer than --seqlen 10000000 + 1"),
    (["--vocab-size", 300], "--vocab-size is for .bin files"),
])
def test_invalid_model_or_data_is_rejected(options, message, tiny, corpus_dir, tmp_path, capsys):
    out = tmp_path / "out"
    err = _rejected(tiny + ["--data", corpus_dir, "--out", out] + options, capsys)
    assert message in err
    assert not out.exists()


def test_data_shorter_than_seqlen_is_rejected(tiny, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("x" * 200)  # the validation split: the last 20 bytes
    err = _rejected(tiny + ["--data", text, "--out", tmp_path / "out", "--seqlen", 32], capsys)
    assert "the validation split" in err and "has 20 tokens, fewer than --seqlen 32 + 1" in err


def test_missing_or_malformed_data_is_rejected(tiny, tmp_path, capsys):
    err = _rejected(tiny + ["--data", tmp_path / "nowhere.txt", "--out", tmp_path / "o"], capsys)
    assert "no such file or folder" in err
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 101)
    err = _rejected(tiny + ["--data", odd, "--out", tmp_path / "o"], capsys)
    assert "101 bytes is not a whole number of uint16 token ids" in err


def test_unwritable_out_is_rejected(tiny, corpus_dir, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = _rejected(tiny + ["--data", corpus_dir, "--out", blocker / "out"], capsys)
    assert f"--out {blocker / 'out'}: cannot write there" in err
    err = _rejected(tiny + ["--data", corpus_dir, "--out", blocker], capsys)
    assert f"--out {blocker}: exists and is not a folder" in err


def test_out_holding_a_run_needs_resume_and_resume_needs_a_checkpoint(tiny, corpus_dir, tmp_path,
                                                                      capsys):
    out = tmp_path / "out"
    err = _rejected(tiny + ["--data", corpus_dir, "--out", out, "--resume"], capsys)
    assert f"--resume: no checkpoint in {out}" in err
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_0000005.pt").write_bytes(b"")
    err = _rejected(tiny + ["--data", corpus_dir, "--out", out], capsys)
    assert "already holds a run (checkpoint step_0000005.pt): pass --resume" in err


def test_resume_rejects_a_different_model(reference, tiny, corpus_dir, capsys):
    out = reference[0]
    before = sorted(p.name for p in out.rglob("*"))
    err = _rejected(_args(tiny, corpus_dir, out) + ["--resume", "--n-layer", 3], capsys)
    assert "differ from the checkpoint's: --n-layer 2 -> 3" in err
    assert sorted(p.name for p in out.rglob("*")) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
def test_cuda_without_a_gpu_is_rejected(corpus_dir, tmp_path, capsys):
    err = _rejected(["--data", corpus_dir, "--out", tmp_path / "o", "--device", "cuda"], capsys)
    assert "--device cuda: CUDA is not available" in err


@pytest.mark.parametrize("option, value", [("--steps", 0), ("--lr", -1), ("--dropout", 1.5),
                                           ("--preset", "gpt5")])
def test_out_of_range_values_are_rejected_by_the_parser(option, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([option, str(value)])
    assert exit_info.value.code == 2
    assert re.search(f"argument {option}: (expected|invalid choice)", capsys.readouterr().err)


# ----------------------------------------------------------------------------------------------
# The schedule and the optimizer.


def test_lr_warms_up_linearly_then_decays_to_the_floor():
    factors = [lr_factor(step, warmup=10, steps=111, min_ratio=0.1) for step in range(111)]
    assert factors[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert factors[10] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.55)  # halfway from step 10 to step 110
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_weight_decay_applies_to_matrices_only():
    from types import SimpleNamespace

    from flash_attn.models.gpt import GPTLMHeadModel
    from flash_attn.models.presets import gpt_config

    model = GPTLMHeadModel(gpt_config("gpt-mini", 256, 16, n_layer=1))
    optimizer, kind = make_optimizer(model, SimpleNamespace(lr=1e-3, weight_decay=0.1))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"])
    assert all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert kind == "fused"  # PyTorch has a fused AdamW for CPU tensors


# ----------------------------------------------------------------------------------------------
# On a GPU: every fused path, bf16 autocast.

GPU_TINY = ["--n-layer", 2, "--n-embd", 128, "--n-head", 2, "--seqlen", 128, "--batch-size", 8,
            "--grad-accum", 2, "--steps", 40, "--warmup", 5, "--lr", 2e-3, "--eval-every", 20,
            "--eval-batches", 2, "--checkpoint-every", 20, "--sample-tokens", 32,
            "--device", "cuda"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", ["gpt2-small", "llama-small"])
def test_gpu_run_uses_every_fused_path(preset, corpus_dir, tmp_path, run_train, read_metrics):
    out = tmp_path / "out"
    n_head_kv = ["--n-head-kv", 1] if preset == "llama-small" else []
    output = run_train(GPU_TINY + n_head_kv + ["--preset", preset, "--data", corpus_dir,
                                               "--out", out]).stdout
    assert "attention: flash" in output and "dropout+add+norm: triton fused" in output, output
    assert ("FusedMLP" in output) == (preset == "gpt2-small")  # gated MLPs have no fused form
    assert "loss: flash_attn triton cross_entropy" in output and "AdamW: fused" in output
    assert "bf16 autocast" in output
    val = read_metrics(out)["history"]["val"]
    assert val[-1][1] < val[0][1] - 1.0, val
    assert (out / "sample.txt").read_text()


def test_chunked_loss_follows_the_logits_loss(reference, tiny, corpus_dir, tmp_path, run_train,
                                              read_metrics):
    """--loss chunked (losses.linear_cross_entropy through forward(targets=...)) trains along the
    same curve as the default loss of the logits: the same losses up to float32 rounding."""
    out = tmp_path / "out"
    run_train(_args(tiny, corpus_dir, out) + ["--loss", "chunked"])
    chunked = read_metrics(out)["history"]
    plain = read_metrics(reference[0])["history"]
    for kind in ("train", "val"):
        got = [row[1] for row in chunked[kind]]
        want = [row[1] for row in plain[kind]]
        assert got == pytest.approx(want, rel=1e-4), kind
