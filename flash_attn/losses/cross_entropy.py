"""nn.Module front end of the fused Triton cross-entropy (flash_attn.ops.triton.cross_entropy)."""

import torch
import torch.nn as nn

from flash_attn.ops.triton.cross_entropy import cross_entropy_loss


class CrossEntropyLoss(nn.Module):
    """Softmax cross-entropy over (batch, vocab_size) logits, optionally vocab-parallel.

    reduction: "mean" (over the rows whose label is not ignore_index), "sum" or "none".
    A label outside [0, vocab_size) (the total vocabulary with process_group) other than
    ignore_index gives that row a NaN loss and NaN gradient, so "mean" and "sum" are NaN: such
    labels are reported, not silently scored as the row's log-sum-exp.
    label_smoothing, logit_scale, lse_square_scale (z-loss), inplace_backward, process_group:
        as in cross_entropy_loss.
    return_z_loss: also return the z-loss term (already included in the loss), reduced the same
        way, for logging.
    """

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_scale=1.0,
                 lse_square_scale=0.0, inplace_backward=False, process_group=None,
                 return_z_loss=False):
        super().__init__()
        if reduction not in ("mean", "none", "sum"):
            raise NotImplementedError(
                f"reduction must be 'mean', 'none' or 'sum', got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.lse_square_scale = lse_square_scale
        self.inplace_backward = inplace_backward
        self.process_group = process_group
        self.return_z_loss = return_z_loss

    def _reduce(self, values, target):
        if self.reduction == "mean":
            return values.sum() / (target != self.ignore_index).sum()
        if self.reduction == "sum":
            return values.sum()
        return values

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        """input: (batch, vocab_size) logits (this rank's slice with process_group);
        target: (batch,) labels. Returns the loss (and the z-loss with return_z_loss)."""
        loss, z_loss = cross_entropy_loss(
            input, target, label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
            lse_square_scale=self.lse_square_scale, ignore_index=self.ignore_index,
            inplace_backward=self.inplace_backward, process_group=self.process_group)
        loss = self._reduce(loss, target)
        if not self.return_z_loss:
            return loss
        return loss, self._reduce(z_loss, target)
