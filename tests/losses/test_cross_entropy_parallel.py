"""Vocab-parallel cross-entropy: two processes, each holding half of the vocabulary, must give the
single-process losses and each its slice of the single-process gradient, and NaN rows exactly for
the labels outside the total vocabulary. gloo on CPU (the Triton interpreter), NCCL on two
GPUs."""

import pytest
import torch
import torch.distributed as dist

from flash_attn.losses.cross_entropy import CrossEntropyLoss
from flash_attn.ops.triton.cross_entropy import cross_entropy_loss, cross_entropy_loss_ref
from flash_attn.utils.testing import run_distributed

WORLD_SIZE = 2
# (dtype, label_smoothing, logit_scale, lse_square_scale, inplace_backward)
CASES = [
    (torch.float32, 0.0, 1.0, 0.0, False),
    (torch.float32, 0.1, 0.8, 1e-3, False),
    (torch.bfloat16, 0.0, 1.0, 1e-2, True),
    (torch.float16, 0.2, 1.0, 0.0, True),
]


def _assert_grad_close(grad, ref_fp32):
    # At most twice the error of rounding the fp32 reference to grad's dtype, plus one ulp
    # (<= |value| * 2^-7) on CPU where the Triton interpreter truncates to bfloat16.
    err = (grad.float() - ref_fp32).abs().max().item()
    err_round = (ref_fp32.to(grad.dtype).float() - ref_fp32).abs().max().item()
    slack = ref_fp32.abs().max().item() * 2.0**-7 if (
        grad.device.type == "cpu" and grad.dtype == torch.bfloat16) else 0.0
    assert err <= 2 * err_round + 1e-6 + slack, (err, err_round)


def _check_case(rank, device, dtype, smoothing, logit_scale, lse_square_scale, inplace_backward,
                n_rows, vocab):
    # Every rank builds the same full problem, then keeps its slice of the vocabulary.
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(n_rows, vocab, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, (n_rows,), generator=gen)
    labels[2::5] = -100
    g = torch.randn(n_rows, generator=gen)
    part = vocab // WORLD_SIZE
    # A copy: with inplace_backward the gradient overwrites it.
    local = logits[:, rank * part:(rank + 1) * part].to(device, copy=True).requires_grad_()
    labels_d, g_d = labels.to(device), g.to(device)

    losses, z_losses = cross_entropy_loss(local, labels_d, smoothing, logit_scale,
                                          lse_square_scale, inplace_backward=inplace_backward,
                                          process_group=dist.group.WORLD)
    (grad,) = torch.autograd.grad(losses, local, g_d)

    full = logits.to(device, copy=True)
    single, z_single = cross_entropy_loss(full, labels_d, smoothing, logit_scale,
                                          lse_square_scale)
    x_ref = logits.float().requires_grad_()
    ref, _ = cross_entropy_loss_ref(x_ref, labels, smoothing, logit_scale, lse_square_scale)
    ref.backward(g)

    torch.testing.assert_close(losses, single.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z_losses, z_single, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    _assert_grad_close(grad.cpu(), x_ref.grad[:, rank * part:(rank + 1) * part])

    # The module's "mean" counts the non-ignored rows, the same on every rank.
    loss = CrossEntropyLoss(process_group=dist.group.WORLD, label_smoothing=smoothing)(
        logits[:, rank * part:(rank + 1) * part].to(device), labels_d)
    expected = cross_entropy_loss_ref(logits.float(), labels, smoothing)[0].sum() / (
        labels != -100).sum()
    torch.testing.assert_close(loss.cpu(), expected, rtol=1e-5, atol=1e-5)


def _check_out_of_range_labels(device, rank, vocab):
    """Only labels outside the total vocabulary give NaN rows (and NaN gradient rows); those in
    the other rank's slice are normal labels."""
    part = vocab // WORLD_SIZE
    gen = torch.Generator().manual_seed(0)
    # part - 1 and part sit on either side of the boundary between the two slices.
    labels = torch.tensor([-1, part - 1, part, vocab - 1, vocab, vocab + 3, -100, 0])
    out_of_range = torch.tensor([True, False, False, False, True, True, False, False])
    logits = torch.randn(len(labels), vocab, generator=gen) * 3
    local = logits[:, rank * part:(rank + 1) * part].to(device, copy=True).requires_grad_()
    losses, _ = cross_entropy_loss(local, labels.to(device), process_group=dist.group.WORLD)
    (grad,) = torch.autograd.grad(losses, local, torch.ones_like(losses))
    losses, grad = losses.cpu(), grad.cpu()

    assert torch.equal(losses.isnan(), out_of_range), losses
    assert torch.equal(grad.isnan().all(dim=1), out_of_range)
    assert grad[~out_of_range].isfinite().all()
    valid = ~out_of_range
    ref, _ = cross_entropy_loss_ref(logits[valid], labels[valid])
    torch.testing.assert_close(losses[valid], ref, rtol=1e-5, atol=1e-5)
    mean = CrossEntropyLoss(process_group=dist.group.WORLD)(local.detach(), labels.to(device))
    assert mean.isnan()


def run_rank(rank, world, backend, n_rows, vocab):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    for case in CASES:
        _check_case(rank, device, *case, n_rows=n_rows, vocab=vocab)
    # In the same ranks: starting two more processes costs more than the check.
    _check_out_of_range_labels(device, rank, vocab)


def test_vocab_parallel_gloo():
    # The gloo ranks compute on CPU tensors, which Triton runs only in its interpreter:
    # run_distributed sets TRITON_INTERPRET=1 for them (also on GPU machines).
    run_distributed(run_rank, WORLD_SIZE, "gloo", args=("gloo", 7, 2 * 150))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_vocab_parallel_nccl():
    run_distributed(run_rank, WORLD_SIZE, "nccl", args=("nccl", 129, 2 * 25000), timeout=600)
