"""linear_cross_entropy (chunked LM head + cross-entropy) against F.linear followed by the
unfused loss: losses and the gradients of hidden, weight and bias, every chunking."""

import math

import pytest
import torch
import torch.nn.functional as F

from flash_attn.losses import linear_cross_entropy as lce_module
from flash_attn.losses.linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy
from flash_attn.ops.triton.cross_entropy import cross_entropy_loss_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n_tokens=37, hidden_size=24, vocab=113, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    hidden = torch.randn(n_tokens, hidden_size, device=DEVICE, dtype=dtype)
    weight = torch.randn(vocab, hidden_size, device=DEVICE, dtype=dtype) / math.sqrt(hidden_size)
    b = torch.randn(vocab, device=DEVICE, dtype=dtype) if bias else None
    labels = torch.randint(0, vocab, (n_tokens,), device=DEVICE)
    labels[::5] = -100
    return hidden, weight, b, labels


def _reference(hidden, weight, bias, labels, reduction, smoothing=0.0, z=0.0):
    logits = F.linear(hidden.float(), weight.float(), bias.float() if bias is not None else None)
    losses, _ = cross_entropy_loss_ref(logits, labels, smoothing, 1.0, z, -100)
    if reduction == "mean":
        return losses.sum() / (labels != -100).sum()
    return losses.sum()


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_size", [1, 7, 37, 64, None])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_unfused(chunk_size, reduction, bias):
    hidden, weight, b, labels = _inputs(bias=bias)
    leaves = [t.requires_grad_() if t is not None else None for t in (hidden, weight, b)]
    loss = linear_cross_entropy(hidden, weight, labels, b, reduction=reduction,
                                chunk_size=chunk_size)
    ref = _reference(hidden, weight, b, labels, reduction)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(_grads(loss * 3.0, leaves), _grads(ref * 3.0, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("smoothing,z", [(0.1, 0.0), (0.0, 1e-3), (0.2, 1e-2)])
def test_label_smoothing_and_z_loss(smoothing, z):
    hidden, weight, b, labels = _inputs(seed=1)
    leaves = [t.requires_grad_() for t in (hidden, weight, b)]
    loss = LinearCrossEntropyLoss(label_smoothing=smoothing, lse_square_scale=z,
                                  chunk_size=10)(hidden, weight, labels, b)
    ref = _reference(hidden, weight, b, labels, "mean", smoothing, z)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(_grads(loss, leaves), _grads(ref, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_plain_pytorch_scoring_matches_the_kernels(monkeypatch):
    """CPU tensors without Triton's interpreter are scored by the PyTorch reference: same result."""
    hidden, weight, b, labels = _inputs(seed=2)
    with_kernels = linear_cross_entropy(hidden, weight, labels, b, chunk_size=8)
    monkeypatch.setattr(lce_module, "triton_interpreter_enabled", lambda: False)
    if hidden.is_cuda:
        hidden, weight, b, labels = (t.cpu() for t in (hidden, weight, b, labels))
    plain = linear_cross_entropy(hidden, weight, labels, b, chunk_size=8)
    torch.testing.assert_close(plain, with_kernels.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("plain", [False, True])
def test_label_outside_the_vocabulary_gives_nan(plain, monkeypatch):
    if plain:
        monkeypatch.setattr(lce_module, "triton_interpreter_enabled", lambda: False)
    hidden, weight, b, labels = _inputs(seed=3)
    if plain:
        hidden, weight, b, labels = (t.cpu() for t in (hidden, weight, b, labels))
    labels[1] = weight.shape[0]
    hidden.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, labels, b, reduction="sum", chunk_size=4)
    assert torch.isnan(loss)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert torch.isnan(grad[1]).all() and torch.isfinite(grad[0]).all()


def test_all_rows_ignored_mean_is_nan_like_torch():
    hidden, weight, b, labels = _inputs()
    labels.fill_(-100)
    loss = linear_cross_entropy(hidden, weight, labels, b)
    ref = F.cross_entropy(F.linear(hidden, weight, b), labels)
    assert torch.isnan(loss) and torch.isnan(ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_autocast_matches_unfused_and_saves_memory():
    """fp32 master weights under bf16 autocast, GPT-2-like vocabulary: within bf16 error of the
    unfused bf16 path (against fp32), with a peak far below the full logits and their gradient."""
    n_tokens, hidden_size, vocab = 8192, 768, 50304
    torch.manual_seed(0)
    hidden = torch.randn(n_tokens, hidden_size, device="cuda", requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device="cuda") * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (n_tokens,), device="cuda")
    ref32 = _reference(hidden, weight, None, labels, "mean")
    g32 = _grads(ref32, [hidden, weight])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref16 = F.cross_entropy(F.linear(hidden, weight).float(), labels)
    g16 = _grads(ref16, [hidden, weight])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=1024)
    grads = _grads(loss, [hidden, weight])
    peak = torch.cuda.max_memory_allocated() - base
    full_logits = n_tokens * vocab * 2
    assert peak < full_logits, f"peak {peak / 2**20:.0f} MiB vs logits {full_logits / 2**20:.0f} MiB"
    assert abs(loss - ref32) <= 2 * abs(ref16 - ref32) + 1e-3
    for got, bf16, want in zip(grads, g16, g32):
        err, base_err = (got - want).abs().max(), (bf16 - want).abs().max()
        assert err <= 2 * base_err + 1e-6, f"{err:.3e} vs bf16 {base_err:.3e}"


@pytest.mark.parametrize("bad,match", [
    (dict(reduction="none"), "reduction"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(labels=torch.zeros(3, dtype=torch.long)), "labels"),
    (dict(weight=torch.zeros(5, 7)), "weight"),
    (dict(bias=torch.zeros(4)), "bias"),
    (dict(labels=torch.zeros(37)), "labels"),
])
def test_bad_arguments_are_named(bad, match):
    hidden, weight, b, labels = _inputs()
    args = dict(hidden=hidden, weight=weight, labels=labels, bias=b)
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in bad.items()})
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(**args)
