"""CrossEntropyLoss (module) against torch.nn.functional.cross_entropy: reductions, ignore_index,
label smoothing, z-loss, gradients."""

import pytest
import torch
import torch.nn.functional as F

from flash_attn.losses.cross_entropy import CrossEntropyLoss

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n_rows=10, vocab=211, ignore_index=-100):
    torch.manual_seed(0)
    logits = torch.randn(n_rows, vocab, device=DEVICE) * 2
    labels = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    labels[::3] = ignore_index
    return logits, labels


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 5])
def test_matches_torch(reduction, label_smoothing, ignore_index):
    logits, labels = _inputs(ignore_index=ignore_index)
    x = logits.clone().requires_grad_()
    x_ref = logits.clone().requires_grad_()
    loss = CrossEntropyLoss(ignore_index=ignore_index, reduction=reduction,
                            label_smoothing=label_smoothing)(x, labels)
    ref = F.cross_entropy(x_ref, labels, ignore_index=ignore_index, reduction=reduction,
                          label_smoothing=label_smoothing)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    loss.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_return_z_loss(reduction):
    logits, labels = _inputs()
    loss, z_loss = CrossEntropyLoss(reduction=reduction, lse_square_scale=1e-2,
                                    return_z_loss=True)(logits, labels)
    kept = labels != -100
    z = 1e-2 * torch.logsumexp(logits, -1) ** 2 * kept
    ce = F.cross_entropy(logits, labels, reduction="none")
    if reduction == "mean":
        z, ce = z.sum() / kept.sum(), ce.sum() / kept.sum()
    elif reduction == "sum":
        z, ce = z.sum(), ce.sum()
    torch.testing.assert_close(z_loss, z, rtol=1e-5, atol=1e-6)
    # The z-loss is included in the loss as well.
    torch.testing.assert_close(loss, ce + z, rtol=1e-5, atol=1e-5)


def test_inplace_backward_module_gradient():
    logits, labels = _inputs()
    x = logits.clone().requires_grad_()
    h = x * 1.0  # the usual case: logits are an intermediate (the lm_head output)
    CrossEntropyLoss(inplace_backward=True)(h, labels).backward()
    x_ref = logits.clone().requires_grad_()
    F.cross_entropy(x_ref, labels).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_labels_outside_vocab_are_not_silent(reduction):
    logits, labels = _inputs(n_rows=6, vocab=211)  # rows 0 and 3 are ignore_index
    labels[1], labels[4] = -7, 211
    x = logits.clone().requires_grad_()
    loss = CrossEntropyLoss(reduction=reduction)(x, labels)
    loss.sum().backward()
    bad = torch.zeros(6, dtype=torch.bool, device=DEVICE)
    bad[[1, 4]] = True
    if reduction == "none":
        assert torch.equal(loss.isnan(), bad)
        assert (loss[labels == -100] == 0).all()
        in_range = ~bad
        torch.testing.assert_close(
            loss[in_range], F.cross_entropy(logits[in_range], labels[in_range], reduction="none"),
            rtol=1e-5, atol=1e-5)
    else:
        assert loss.isnan()
    assert torch.equal(x.grad.isnan().all(dim=1), bad) and x.grad[~bad].isfinite().all()


def test_unknown_reduction_raises():
    with pytest.raises(NotImplementedError, match="reduction"):
        CrossEntropyLoss(reduction="batchmean")
