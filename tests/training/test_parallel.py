"""training/train.py under torchrun on CPU (gloo, 2 processes): DDP and FSDP2 follow the
one-process run with the doubled batch, and an FSDP checkpoint resumes.

Two processes with batch B read exactly the windows one process with batch 2B reads
(training.data.WindowSampler), so the runs differ only in the order fp32 sums are taken: how the
GEMMs split a batch of B rows rather than 2B, and the gradient average over the processes."""

import shutil

import pytest
import torch

from training import checkpoint

STEPS = 6
# Each step's loss agrees within a few fp32 roundings of the loss (one is 4.8e-7 at ~5; seen: one),
# amplified a little by the steps before it; a different batch is off by 1e-2 or more. The
# gradient norm tells a sum over the processes from a mean, which Adam alone would hide.
LOSS_ATOL = 1e-5
GRAD_NORM_RTOL = 1e-5


def _args(tiny, corpus_dir, out, batch):
    return tiny + ["--data", corpus_dir, "--out", out, "--steps", STEPS, "--grad-accum", 2,
                   "--batch-size", batch, "--eval-every", 3, "--checkpoint-every", 3,
                   "--keep-checkpoints", 5, "--dropout", 0]


@pytest.fixture(scope="module")
def single(tiny, corpus_dir, tmp_path_factory, run_train, read_metrics):
    """The history of one process with batch 4."""
    out = tmp_path_factory.mktemp("single") / "out"
    run_train(_args(tiny, corpus_dir, out, batch=4))
    return read_metrics(out)["history"]


@pytest.fixture(scope="module")
def fsdp(tiny, corpus_dir, tmp_path_factory, run_train):
    """(out folder, output) of two FSDP processes with batch 2 each."""
    out = tmp_path_factory.mktemp("fsdp") / "out"
    proc = run_train(_args(tiny, corpus_dir, out, batch=2) + ["--parallel", "fsdp"], nproc=2)
    return out, proc.stdout


def _assert_follows(history, reference):
    assert [row[0] for row in history["train"]] == list(range(1, STEPS + 1))
    for got, expected in zip(history["train"], reference["train"]):
        assert got[1] == pytest.approx(expected[1], abs=LOSS_ATOL), (got, expected)
        assert got[3] == pytest.approx(expected[3], rel=GRAD_NORM_RTOL), (got, expected)
    for (step, got), (_, expected) in zip(history["val"], reference["val"]):
        assert got == pytest.approx(expected, abs=LOSS_ATOL), step


def test_ddp_on_two_processes_follows_one_process_with_the_doubled_batch(
        single, tiny, corpus_dir, tmp_path, run_train, read_metrics):
    out = tmp_path / "out"
    proc = run_train(_args(tiny, corpus_dir, out, batch=2) + ["--parallel", "ddp"], nproc=2)
    assert "cpu, 2 processes, ddp" in proc.stdout
    _assert_follows(read_metrics(out)["history"], single)


def test_fsdp_on_two_processes_follows_one_process_with_the_doubled_batch(fsdp, single,
                                                                           read_metrics):
    out, output = fsdp
    assert "cpu, 2 processes, fsdp" in output
    _assert_follows(read_metrics(out)["history"], single)
    # The checkpoint holds whole tensors, not one process's shard.
    state = checkpoint.read(checkpoint.latest_checkpoint(out))["model"]
    assert state["transformer.layers.0.mixer.Wqkv.weight"].shape == (3 * 32, 32)
    assert len(checkpoint.read(checkpoint.latest_checkpoint(out))["rng"]) == 2


def test_fsdp_checkpoint_resumes_to_the_same_losses(fsdp, tiny, corpus_dir, tmp_path, run_train,
                                                    read_metrics):
    out, _ = fsdp
    resumed = tmp_path / "out"
    # What a run killed after step 3's checkpoint leaves behind: that checkpoint.
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoint.checkpoint_path(out, 3), resumed / "checkpoints")
    proc = run_train(_args(tiny, corpus_dir, resumed, batch=2) + ["--parallel", "fsdp", "--resume"],
                     nproc=2)
    assert "resuming at step 3" in proc.stdout
    expected, got = read_metrics(out)["history"], read_metrics(resumed)["history"]
    assert got == expected  # the same processes: the same sums in the same order
    final = checkpoint.read(checkpoint.latest_checkpoint(resumed))["model"]
    reference = checkpoint.read(checkpoint.latest_checkpoint(out))["model"]
    assert all(torch.equal(final[k], reference[k]) for k in reference)



def test_fsdp_checkpoint_resumes_in_one_process(fsdp, single, tiny, corpus_dir, tmp_path,
                                                run_train, read_metrics):
    """Whole tensors in the checkpoint: two FSDP processes' step 3 goes on in one process with
    the doubled batch (the same windows), following the one-process run."""
    out, _ = fsdp
    resumed = tmp_path / "out"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoint.checkpoint_path(out, 3), resumed / "checkpoints")
    proc = run_train(_args(tiny, corpus_dir, resumed, batch=4) + ["--resume"])
    assert "RNG states of 2 processes, this run has 1" in proc.stdout
    _assert_follows(read_metrics(resumed)["history"], single)

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_nccl_on_two_gpus_follows_one_gpu(parallel, corpus_dir, tmp_path, run_train,
                                          read_metrics):
    """bf16 autocast: the GEMMs round differently for batches of 2 and 4, so the losses agree
    to bf16's precision, not fp32's."""
    gpu = ["--preset", "gpt2-small", "--n-layer", 2, "--n-embd", 128, "--n-head", 2,
           "--seqlen", 64, "--steps", STEPS, "--grad-accum", 2, "--eval-every", 3,
           "--eval-batches", 2, "--checkpoint-every", 3, "--sample-tokens", 8, "--device", "cuda",
           "--data", corpus_dir]
    run_train(gpu + ["--batch-size", 4, "--out", tmp_path / "one"])
    output = run_train(gpu + ["--batch-size", 2, "--out", tmp_path / "two", "--parallel",
                              parallel], nproc=2).stdout
    assert f"2 processes, {parallel}" in output and "attention: flash" in output
    one, two = (read_metrics(tmp_path / name)["history"]["train"] for name in ("one", "two"))
    for a, b in zip(one, two):
        assert b[1] == pytest.approx(a[1], rel=2e-2), (a, b)
