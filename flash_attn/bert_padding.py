"""Remove and restore padding tokens, so that variable-length batches run through the varlen kernels.

A padded batch (b, s, ...) with a (b, s) validity mask becomes a packed (total, ...) tensor plus
`indices` (positions of the kept tokens in the flattened b*s axis) and `cu_seqlens` (int32 prefix
sums of the per-sequence lengths, b + 1 entries), the layout that `flash_attn_varlen_func` takes.

The gather and scatter are autograd Functions that move rows by index: neither direction builds a
dense (b*s, ...) mask product, so backward costs O(total) work plus one zero-filled buffer.
Indices may be int32 or int64 (HF transformers hands int32 ones for single-token decoding).
"""

import torch
import torch.nn.functional as F


def _as_index(indices):
    """int64 view of an int32 or int64 index tensor: index_copy_ takes only int64, and one cast
    here keeps every Function below agnostic of what the caller handed."""
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"flash_attn.bert_padding: indices must be int32 or int64, got {indices.dtype}")
    return indices.long()


class IndexFirstAxis(torch.autograd.Function):
    """out = input[indices] along the first axis; backward scatters the rows back."""

    @staticmethod
    def forward(ctx, input, indices):
        indices = _as_index(indices)
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        grad_input = grad_output.new_zeros((ctx.first_axis_dim, *grad_output.shape[1:]))
        # index_add (not an overwrite) keeps the gradient right if an index repeats.
        grad_input.index_add_(0, indices, grad_output)
        return grad_input, None


index_first_axis = IndexFirstAxis.apply


class IndexPutFirstAxis(torch.autograd.Function):
    """out = zeros(first_axis_dim, ...); out[indices] = values; backward gathers the rows."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        indices = _as_index(indices)
        ctx.save_for_backward(indices)
        output = values.new_zeros((first_axis_dim, *values.shape[1:]))
        output.index_copy_(0, indices, values)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return grad_output.index_select(0, indices), None, None


index_put_first_axis = IndexPutFirstAxis.apply


class IndexFirstAxisResidual(torch.autograd.Function):
    """Returns (input[indices], input): the gathered rows and the full input as a residual.

    Used where a layer keeps working on a subset of tokens while the residual stream stays whole;
    both gradients land in one buffer, so the input's gradient is built without a second pass.
    """

    @staticmethod
    def forward(ctx, input, indices):
        indices = _as_index(indices)
        ctx.save_for_backward(indices)
        return input.index_select(0, indices), input.detach()

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        (indices,) = ctx.saved_tensors
        # Out-of-place: the incoming gradient buffer may be shared with other consumers.
        return grad_residual.index_add(0, indices, grad_output), None


index_first_axis_residual = IndexFirstAxisResidual.apply


def _flatten_batch(hidden_states):
    return hidden_states.reshape(-1, *hidden_states.shape[2:])


def _cu_seqlens(seqlens):
    return F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Packs the selected tokens of a padded batch.

    hidden_states: (b, s, ...). attention_mask: (b, s) bool or 0/1 int, True = valid token.
    unused_mask: optional (b, s), True = a token that is kept in the packed tensor (it occupies a
    slot, e.g. space reserved for later tokens) but is not counted as used.
    Returns (hidden_states_unpadded (total, ...), indices (total,) int64 into the flattened b*s
    axis, cu_seqlens (b + 1,) int32, max_seqlen_in_batch (int), seqused (b,) int32): cu_seqlens
    and max_seqlen cover the kept tokens (attention_mask | unused_mask), seqused counts only the
    attention_mask tokens.
    """
    used = attention_mask.bool()
    kept = used if unused_mask is None else used | unused_mask.bool()
    seqlens_in_batch = kept.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item()) if seqlens_in_batch.numel() else 0
    return (
        index_first_axis(_flatten_batch(hidden_states), indices),
        indices,
        _cu_seqlens(seqlens_in_batch),
        max_seqlen_in_batch,
        seqused,
    )


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Packs batches whose rows each hold several sequences laid end to end.

    attention_mask_in_length: (b, s) int; row i lists the lengths of the sequences packed into
    row i, followed by zeros. For example [[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0]] says row 0
    holds sequences of 2 and 3 tokens (positions 0-1 and 2-4) and row 1 holds 3 and 2 tokens.
    Returns (hidden_states_unpadded, indices, cu_seqlens, max_seqlen_in_batch): cu_seqlens has one
    entry per packed sequence (plus the leading 0), so attention never crosses sequence borders.
    """
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    row_tokens = lengths.sum(dim=-1)
    # Every row's sequences fill a prefix of that row.
    positions = torch.arange(seqlen, device=lengths.device)
    kept = positions.unsqueeze(0) < row_tokens.unsqueeze(1)
    flat_lengths = lengths.flatten()
    seqlens = flat_lengths[flat_lengths != 0]
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens.max().item()) if seqlens.numel() else 0
    return (
        index_first_axis(_flatten_batch(hidden_states), indices),
        indices,
        _cu_seqlens(seqlens),
        max_seqlen_in_batch,
    )


def pad_input(hidden_states, indices, batch, seqlen):
    """Inverse of unpad_input: (total, ...) rows go back to their slots of a zero (b, s, ...)."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *hidden_states.shape[1:])
