"""cross_entropy_loss (Triton) against a float32 PyTorch reference: losses, z-losses and
gradients; small shapes on CPU (the Triton interpreter), vocabulary-sized ones on the GPU."""

import pytest
import torch
import torch.nn.functional as F

from flash_attn.ops.triton.cross_entropy import (
    _backward_launch,
    _forward_launch,
    cross_entropy_loss,
    cross_entropy_loss_ref,
)
from flash_attn.utils.testing import triton_interpreter_slack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _assert_grad_close(grad, ref_fp32):
    """The kernel computes in fp32 and rounds once: its error against the fp32 reference is at
    most twice the error of rounding the reference itself to grad's dtype."""
    assert grad.dtype != torch.float32 or grad.isfinite().all()
    err = (grad.float() - ref_fp32).abs().max().item()
    err_round = (ref_fp32.to(grad.dtype).float() - ref_fp32).abs().max().item()
    slack = triton_interpreter_slack(grad.dtype, ref_fp32)
    assert err <= 2 * err_round + 1e-6 + slack, (err, err_round)


def _make_inputs(n_rows, vocab, dtype, device, ignore_index=-100, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn(n_rows, vocab, generator=gen) * 3).to(device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (n_rows,), generator=gen).to(device)
    labels[1::4] = ignore_index
    return logits, labels


def _check(logits, labels, smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
           ignore_index=-100, inplace_backward=False):
    torch.manual_seed(1)
    x = logits.clone().requires_grad_()
    losses, z_losses = cross_entropy_loss(x, labels, smoothing, logit_scale, lse_square_scale,
                                          ignore_index, inplace_backward)
    assert losses.dtype == z_losses.dtype == torch.float32 and not z_losses.requires_grad
    g = torch.randn_like(losses)
    (grad,) = torch.autograd.grad(losses, x, g)
    if inplace_backward:
        assert grad.data_ptr() == x.data_ptr()

    x_ref = logits.float().requires_grad_()
    ref, z_ref = cross_entropy_loss_ref(x_ref, labels, smoothing, logit_scale, lse_square_scale,
                                        ignore_index)
    ref.backward(g)
    torch.testing.assert_close(losses, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z_losses, z_ref.detach(), rtol=1e-5, atol=1e-6)
    _assert_grad_close(grad, x_ref.grad)
    ignored = labels == ignore_index
    assert (losses[ignored] == 0).all() and (grad[ignored] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [97, 1000])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("lse_square_scale", [0.0, 1e-2])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_cross_entropy_small(dtype, vocab, smoothing, lse_square_scale, inplace_backward):
    logits, labels = _make_inputs(6, vocab, dtype, DEVICE)
    _check(logits, labels, smoothing, 0.7 if smoothing else 1.0, lse_square_scale,
           inplace_backward=inplace_backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1001, 1024])
def test_small_blocks_unaligned_rows(dtype, vocab):
    # Blocks of 64 over a 1001-wide vocabulary: rows start at every offset modulo 16 bytes, so
    # the kernels' masked edge blocks and unmasked interior blocks all run. 1024: aligned rows of
    # whole blocks, and a last block wholly past each row's end (max -inf, sum 0).
    logits, labels = _make_inputs(9, vocab, dtype, DEVICE)
    n = logits.shape[0]
    losses, z_losses, lse = (torch.empty(n, device=DEVICE) for _ in range(3))
    _forward_launch(logits, labels, losses, z_losses, lse, 0.1, 1.0, 0.0, -100, vocab, 0,
                    split=False, block=64, num_warps=2)
    x_ref = logits.float().requires_grad_()
    ref, _ = cross_entropy_loss_ref(x_ref, labels, 0.1)
    g = torch.randn(n, device=DEVICE)
    ref.backward(g)
    torch.testing.assert_close(losses, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1), rtol=1e-5, atol=1e-5)
    dlogits = torch.full_like(logits, float("nan"))
    _backward_launch(dlogits, g, logits, lse, labels, 0.1, 1.0, 0.0, -100, vocab, 0, block=64,
                     num_warps=2)
    _assert_grad_close(dlogits, x_ref.grad)


def test_strided_and_column_major_logits():
    logits, labels = _make_inputs(5, 301, torch.float16, DEVICE)
    # A slice of a wider buffer: row stride 310, storage offset 3 (not 16-byte aligned).
    wide = torch.zeros(5, 310, device=DEVICE, dtype=torch.float16)
    wide[:, 3:304] = logits
    wide.requires_grad_()
    losses, _ = cross_entropy_loss(wide[:, 3:304], labels, label_smoothing=0.1)
    g = torch.randn_like(losses)
    losses.backward(g)
    x_ref = logits.float().requires_grad_()
    ref, _ = cross_entropy_loss_ref(x_ref, labels, 0.1)
    ref.backward(g)
    torch.testing.assert_close(losses, ref.detach(), rtol=1e-5, atol=1e-5)
    _assert_grad_close(wide.grad[:, 3:304], x_ref.grad)
    assert (wide.grad[:, :3] == 0).all() and (wide.grad[:, 304:] == 0).all()
    # Column-major logits are made row-major first.
    _check(logits.t().contiguous().t(), labels, lse_square_scale=1e-3)


def test_matches_torch_cross_entropy():
    # Independent of cross_entropy_loss_ref: torch's own loss, with smoothing and ignore_index.
    logits, labels = _make_inputs(8, 300, torch.float32, DEVICE, ignore_index=-1)
    for smoothing in (0.0, 0.2):
        ours, _ = cross_entropy_loss(logits, labels, label_smoothing=smoothing, ignore_index=-1)
        expected = F.cross_entropy(logits, labels, label_smoothing=smoothing, ignore_index=-1,
                                   reduction="none")
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_z_loss_and_logit_scale_formula():
    logits, labels = _make_inputs(4, 50, torch.float32, DEVICE)
    labels[:] = torch.arange(4)
    losses, z_losses = cross_entropy_loss(logits, labels, logit_scale=0.5, lse_square_scale=0.1)
    lse = torch.logsumexp(0.5 * logits, -1)
    torch.testing.assert_close(z_losses, 0.1 * lse**2)
    picked = 0.5 * logits[torch.arange(4), labels]
    torch.testing.assert_close(losses, lse - picked + 0.1 * lse**2)


def test_all_rows_ignored_and_empty_batch():
    logits, _ = _make_inputs(3, 40, torch.float32, DEVICE)
    labels = torch.full((3,), 7, device=DEVICE)
    x = logits.clone().requires_grad_()
    losses, z = cross_entropy_loss(x, labels, lse_square_scale=1.0, ignore_index=7)
    losses.sum().backward()
    assert (losses == 0).all() and (z == 0).all() and (x.grad == 0).all()
    empty = torch.zeros(0, 40, device=DEVICE, requires_grad=True)
    losses, _ = cross_entropy_loss(empty, torch.zeros(0, dtype=torch.long, device=DEVICE))
    losses.sum().backward()
    assert losses.shape == (0,) and empty.grad.shape == (0, 40)


@pytest.mark.parametrize("smoothing, lse_square_scale", [(0.0, 0.0), (0.1, 1e-2)])
def test_labels_outside_vocab_give_nan_rows(smoothing, lse_square_scale):
    vocab = 40
    logits, labels = _make_inputs(7, vocab, torch.float32, DEVICE)
    # -100 is ignore_index; -1, vocab and vocab + 5 are outside [0, vocab).
    labels[:5] = torch.tensor([-1, vocab, -100, vocab + 5, vocab - 1])
    out_of_range = torch.tensor([True, True, False, True, False, False, False], device=DEVICE)
    ignored = labels == -100
    valid = ~out_of_range & ~ignored
    x = logits.clone().requires_grad_()
    losses, z_losses = cross_entropy_loss(x, labels, smoothing, 1.0, lse_square_scale)
    (grad,) = torch.autograd.grad(losses, x, torch.ones_like(losses))

    assert torch.equal(losses.isnan(), out_of_range)
    assert (losses[ignored] == 0).all() and (grad[ignored] == 0).all()
    assert grad[out_of_range].isnan().all() and grad[~out_of_range].isfinite().all()
    # The z-loss does not depend on the label: the out-of-range rows keep theirs.
    torch.testing.assert_close(z_losses[~ignored],
                               lse_square_scale * torch.logsumexp(logits[~ignored], -1) ** 2)
    # The other rows are untouched by their NaN neighbours.
    x_ref = logits[valid].clone().requires_grad_()
    ref, _ = cross_entropy_loss_ref(x_ref, labels[valid], smoothing, 1.0, lse_square_scale)
    ref.sum().backward()
    torch.testing.assert_close(losses[valid], ref.detach(), rtol=1e-5, atol=1e-5)
    _assert_grad_close(grad[valid], x_ref.grad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(logits=torch.randn(2, 3, 4)), "logits must be a 2-D"),
    (dict(logits=torch.randn(2, 4, dtype=torch.float64)), "logits must be a 2-D"),
    (dict(labels=torch.zeros(3, dtype=torch.long)), "labels must be an int64 or int32 tensor"),
    (dict(labels=torch.zeros(2)), "labels must be an int64 or int32 tensor"),
    (dict(label_smoothing=1.5), "label_smoothing must be in"),
    (dict(logit_scale=0.0), "logit_scale must be > 0"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(logits=torch.randn(2, 4), labels=torch.zeros(2, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        cross_entropy_loss(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [50257, 128256, 1000])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("lse_square_scale", [0.0, 1e-4])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_cross_entropy_gpu(dtype, vocab, smoothing, lse_square_scale, inplace_backward):
    logits, labels = _make_inputs(67, vocab, dtype, "cuda")
    _check(logits, labels, smoothing, 1.0 if smoothing else 0.8, lse_square_scale,
           inplace_backward=inplace_backward)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_inplace_backward_allocates_no_logits_sized_buffer(inplace_backward):
    logits, labels = _make_inputs(4096, 50257, torch.bfloat16, "cuda")
    logits.requires_grad_()
    logits_bytes = logits.numel() * logits.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    losses, _ = cross_entropy_loss(logits, labels, inplace_backward=inplace_backward)
    (grad,) = torch.autograd.grad(losses.sum(), logits)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    if inplace_backward:
        assert grad.data_ptr() == logits.data_ptr()
        assert extra < 0.05 * logits_bytes, extra / logits_bytes
    else:
        assert logits_bytes <= extra < 1.05 * logits_bytes, extra / logits_bytes
