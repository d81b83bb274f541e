"""LM head + cross-entropy in one op that never holds the full (tokens, vocab) logits.

The loss of logits = hidden @ weight.T (+ bias) against labels, computed a chunk of rows at a time:
each chunk's logits are made, scored and turned into their gradient in place, and that gradient is
folded at once into the gradients of hidden, weight and bias; then the chunk's logits are freed.
Peak memory is one chunk of logits instead of all of them (GPT-2's 50k vocabulary at 16k tokens:
1.6 GB of bf16 logits, plus as much again for their gradient). The gradients are computed in the
forward (the loss is a scalar, so the backward only scales them by the incoming gradient).

On CUDA (or under TRITON_INTERPRET=1) the scoring is flash_attn.ops.triton.cross_entropy's
kernels; on CPU its plain-PyTorch reference.
"""

import torch
import torch.nn as nn

from flash_attn.ops.triton import cross_entropy as ce
from flash_attn.ops.triton.launch_device import triton_interpreter_enabled
from flash_attn.utils.autocast import compute_dtype

CHUNK_BYTES = 1 << 28  # default chunk: about 256 MB of logits


def _fail(name, expected, got):
    raise ValueError(f"linear_cross_entropy: {name} must be {expected}, got {got}")


def _check_args(hidden, weight, labels, bias, reduction, chunk_size):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        _fail("hidden", "a 2-D (tokens, hidden_size) float tensor",
              f"shape {tuple(getattr(hidden, 'shape', ()))}")
    n_tokens, hidden_size = hidden.shape
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2
            or weight.shape[1] != hidden_size):
        _fail("weight", f"a 2-D (vocab_size, {hidden_size}) tensor",
              f"shape {tuple(getattr(weight, 'shape', ()))}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        _fail("bias", f"of shape ({weight.shape[0]},)", f"shape {tuple(bias.shape)}")
    if (not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (n_tokens,)
            or labels.dtype not in (torch.int32, torch.int64)):
        _fail("labels", f"an int64 or int32 tensor of shape ({n_tokens},)",
              f"{getattr(labels, 'dtype', type(labels).__name__)} of shape "
              f"{tuple(getattr(labels, 'shape', ()))}")
    for name, t in (("weight", weight), ("labels", labels), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            _fail(name, f"on {hidden.device} like hidden", t.device)
    if reduction not in ("mean", "sum"):
        # The gradients are made in the forward, which needs the weight of every row now.
        _fail("reduction", "'mean' or 'sum' (per-row losses would need the full logits' "
              "gradient; use CrossEntropyLoss on the logits for reduction='none')", repr(reduction))
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        _fail("chunk_size", "a positive int or None", repr(chunk_size))


def _score_chunk(logits, labels, row_grad, smoothing, lse_square_scale, ignore_index):
    """Per-row losses (float32) of a chunk, with logits overwritten by d(sum row_grad * loss)."""
    if logits.is_cuda or triton_interpreter_enabled():
        n_rows, vocab_size = logits.shape
        losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        z_losses, lse = torch.empty_like(losses), torch.empty_like(losses)
        args = (smoothing, 1.0, lse_square_scale, ignore_index, vocab_size, 0)
        ce._forward_launch(logits, labels, losses, z_losses, lse, *args, split=False)
        ce._backward_launch(logits, row_grad, logits, lse, labels, *args)
        return losses
    # As the kernels do: a label outside the vocabulary (other than ignore_index) gives its row
    # a NaN loss and gradient.
    vocab_size = logits.shape[1]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    with torch.enable_grad():
        x = logits.detach().float().requires_grad_()
        losses, _ = ce.cross_entropy_loss_ref(x, labels.masked_fill(bad, 0), smoothing, 1.0,
                                              lse_square_scale, ignore_index)
        (grad,) = torch.autograd.grad(losses, x, row_grad.expand_as(losses))
    logits.copy_(grad.masked_fill_(bad[:, None], float("nan")))
    return losses.detach().masked_fill_(bad, float("nan"))


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, label_smoothing,
                lse_square_scale, reduction, chunk_size):
        _check_args(hidden, weight, labels, bias, reduction, chunk_size)
        dtype = compute_dtype(hidden.device.type, hidden.dtype)
        n_tokens, vocab_size = hidden.shape[0], weight.shape[0]
        if chunk_size is None:
            chunk_size = max(1, CHUNK_BYTES // (vocab_size * torch.finfo(dtype).bits // 8))
        labels = labels.contiguous()
        # One cast of each operand up front; the matmuls below run in `dtype` with autocast off,
        # so every chunk computes exactly what F.linear would under autocast.
        h, w = hidden.to(dtype), weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        if reduction == "mean":
            row_grad = 1.0 / (labels != ignore_index).sum().to(torch.float32)
        else:
            row_grad = torch.ones((), dtype=torch.float32, device=hidden.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(h)
        grad_weight = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        grad_bias = (torch.zeros(vocab_size, dtype=torch.float32, device=w.device)
                     if bias is not None else None)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n_tokens, chunk_size):
                rows = slice(start, min(start + chunk_size, n_tokens))
                logits = h[rows] @ w.t() if b is None else torch.addmm(b, h[rows], w.t())
                n_rows = logits.shape[0]
                losses = _score_chunk(logits, labels[rows], row_grad.expand(n_rows),
                                      float(label_smoothing), float(lse_square_scale),
                                      ignore_index)
                loss += losses.sum()
                dlogits = logits  # _score_chunk left the gradient in place
                torch.mm(dlogits, w, out=grad_hidden[rows])
                grad_weight += dlogits.t() @ h[rows]
                if grad_bias is not None:
                    grad_bias += dlogits.sum(0, dtype=torch.float32)
                del logits, dlogits
        ctx.save_for_backward(grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype),
                              grad_bias.to(bias.dtype) if bias is not None else None)
        return loss * row_grad

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        grads = [g * scale.to(g.dtype) if g is not None else None
                 for g in (grad_hidden, grad_weight, grad_bias)]
        return (*grads, None, None, None, None, None, None)


def linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100,
                         label_smoothing=0.0, lse_square_scale=0.0, reduction="mean",
                         chunk_size=None):
    """Cross-entropy of hidden @ weight.T (+ bias) against labels, chunked (module docstring).

    hidden: (tokens, hidden_size); weight: (vocab_size, hidden_size), e.g. the LM head's (tied or
    not); bias: (vocab_size,) or None; labels: (tokens,) int64/int32, ignore_index rows are left
    out of the loss ("mean" divides by the other rows). label_smoothing, lse_square_scale (z-loss):
    as in flash_attn.losses.cross_entropy.CrossEntropyLoss. reduction: "mean" or "sum".
    chunk_size: rows per chunk (default: about 256 MB of logits). Under autocast the matmuls run
    in autocast's dtype, as F.linear would; the loss is float32.
    """
    return LinearCrossEntropyFunction.apply(hidden, weight, bias, labels, ignore_index,
                                            label_smoothing, lse_square_scale, reduction,
                                            chunk_size)


class LinearCrossEntropyLoss(nn.Module):
    """nn.Module form of linear_cross_entropy: loss(hidden, weight, labels, bias=None)."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 lse_square_scale=0.0, chunk_size=None):
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lse_square_scale = lse_square_scale
        self.chunk_size = chunk_size

    def forward(self, hidden, weight, labels, bias=None):
        return linear_cross_entropy(hidden, weight, labels, bias, self.ignore_index,
                                    self.label_smoothing, self.lse_square_scale, self.reduction,
                                    self.chunk_size)
