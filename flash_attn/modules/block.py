"""Transformer blocks. Block: mixer (attention) then MLP, each wrapped in dropout + residual add
+ norm, pre-norm (GPT) or post-norm (BERT). ParallelBlock: mixer and MLP side by side on the same
normalised input (GPT-J / GPT-NeoX).

Pre-norm blocks pass (hidden_states, residual) along so that "dropout, add, norm" is one step at
the start of the next block, which fused_dropout_add_ln turns into one Triton kernel
(flash_attn.ops.triton.layer_norm.layer_norm_fn).
"""

from functools import partial

import torch
import torch.nn as nn

from flash_attn.modules.mha import MHA, import_optional, warn_fallback
from flash_attn.modules.mlp import Mlp


class DropPath(nn.Module):
    """Stochastic depth: drops the whole branch for a random subset of samples (dim 0)."""

    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


def _is_rms_norm(norm):
    return "RMSNorm" in type(norm).__name__


def _norm_eps(norm, dtype):
    eps = getattr(norm, "eps", None)
    return eps if eps is not None else torch.finfo(dtype).eps  # nn.RMSNorm's default


def fused_add_norm_fn(fused_dropout_add_ln):
    """layer_norm_fn when the fused path is asked for and importable, else None (plain path)."""
    if not fused_dropout_add_ln:
        return None
    fn = import_optional("flash_attn.ops.triton.layer_norm", "layer_norm_fn")
    if fn is None:
        warn_fallback("fused_dropout_add_ln", "flash_attn.ops.triton.layer_norm is unavailable")
    return fn


def _mark_params(modules, sequence_parallel, mark_shared_params):
    """Tag norm parameters: replicated on every tensor-parallel rank (their grads are summed
    over the sequence-parallel group by utils.distributed.allreduce_sequence_parallel_grad)."""
    for module in modules:
        for p in module.parameters():
            if sequence_parallel:
                p._sequence_parallel = True
            if mark_shared_params:
                p._shared_params = True


class Block(nn.Module):
    def __init__(self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm,
                 dropout_cls=nn.Dropout, prenorm=True, resid_dropout1=0.0, resid_dropout2=0.0,
                 drop_path1=0.0, drop_path2=0.0, fused_dropout_add_ln=False,
                 return_residual=False, residual_in_fp32=False, sequence_parallel=False,
                 mark_shared_params=False):
        """return_residual: the mixer and MLP return (output, input), which a post-norm block
        uses as the residual (lets a fused dense layer fuse the residual's backward)."""
        super().__init__()
        if residual_in_fp32 and not prenorm:
            raise ValueError("Block: residual_in_fp32 only applies to prenorm blocks")
        mixer_cls = mixer_cls if mixer_cls is not None else partial(MHA, num_heads=dim // 64)
        mlp_cls = mlp_cls if mlp_cls is not None else partial(Mlp, hidden_features=4 * dim)
        self.prenorm, self.return_residual = prenorm, return_residual
        self.residual_in_fp32 = residual_in_fp32
        self.layer_norm_fn = fused_add_norm_fn(fused_dropout_add_ln)
        self.fused_dropout_add_ln = self.layer_norm_fn is not None

        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.drop_path1 = DropPath(drop_path1)
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        norms = [self.norm1]
        if not isinstance(self.mlp, nn.Identity):
            self.dropout2 = dropout_cls(resid_dropout2)
            self.drop_path2 = DropPath(drop_path2)
            self.norm2 = norm_cls(dim)
            norms.append(self.norm2)
        _mark_params(norms, sequence_parallel, mark_shared_params)

    def extra_repr(self):
        return (f"prenorm={self.prenorm}, "
                f"add_norm={'triton fused' if self.fused_dropout_add_ln else 'torch'}")

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def _dropout_add_norm(self, x, residual, norm, dropout, drop_path, prenorm):
        """norm(drop_path(dropout(x)) + residual); prenorm also returns the sum (the residual)."""
        if self.fused_dropout_add_ln:
            rowscale = None
            if self.training and drop_path.p > 0.0:
                rowscale = drop_path(x.new_ones(x.shape[:-1]))
            return self.layer_norm_fn(
                x, norm.weight, getattr(norm, "bias", None), residual=residual,
                eps=_norm_eps(norm, x.dtype), dropout_p=dropout.p if self.training else 0.0,
                rowscale=rowscale, prenorm=prenorm, residual_in_fp32=self.residual_in_fp32,
                is_rms_norm=_is_rms_norm(norm))
        dropped = drop_path(dropout(x))
        residual = dropped if residual is None else dropped + residual
        out = norm(residual.to(dtype=norm.weight.dtype))
        if not prenorm:
            return out
        return out, (residual.float() if self.residual_in_fp32 else residual)

    def forward(self, hidden_states, residual=None, mixer_subset=None, mixer_kwargs=None):
        """Pre-norm: (hidden_states, residual) -> (hidden_states, residual), where the input
        residual is None for the first block. Post-norm: hidden_states -> hidden_states.
        mixer_subset: keep only these positions (dim 1) after the mixer (e.g. the CLS token)."""
        mixer_kwargs = dict(mixer_kwargs or {})
        if mixer_subset is not None:
            mixer_kwargs["mixer_subset"] = mixer_subset
        has_mlp = not isinstance(self.mlp, nn.Identity)
        if self.prenorm:
            hidden_states, residual = self._dropout_add_norm(
                hidden_states, residual, self.norm1, self.dropout1, self.drop_path1, True)
            hidden_states = self.mixer(hidden_states, **mixer_kwargs)
            if mixer_subset is not None:
                residual = residual[:, mixer_subset]
            if has_mlp:
                hidden_states, residual = self._dropout_add_norm(
                    hidden_states, residual, self.norm2, self.dropout2, self.drop_path2, True)
                hidden_states = self.mlp(hidden_states)
            return hidden_states, residual

        if residual is not None:
            raise ValueError("Block: a post-norm block takes no residual")
        mixer_out = self.mixer(hidden_states, **mixer_kwargs)
        if self.return_residual:
            mixer_out, hidden_states = mixer_out
        elif mixer_subset is not None:
            hidden_states = hidden_states[:, mixer_subset]
        hidden_states = self._dropout_add_norm(mixer_out, hidden_states, self.norm1,
                                               self.dropout1, self.drop_path1, False)
        if has_mlp:
            mlp_out = self.mlp(hidden_states)
            if self.return_residual:
                mlp_out, hidden_states = mlp_out
            hidden_states = self._dropout_add_norm(mlp_out, hidden_states, self.norm2,
                                                   self.dropout2, self.drop_path2, False)
        return hidden_states


class ParallelBlock(nn.Module):
    """Attention and MLP computed in parallel from the same residual stream (GPT-J, GPT-NeoX):
    residual += dropout1(attn_out) + dropout2(mlp_out); attn_in = norm1(residual),
    mlp_in = norm2(residual) (or norm1's output when tied_norm)."""

    def __init__(self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm,
                 dropout_cls=nn.Dropout, resid_dropout1=0.0, resid_dropout2=0.0, tied_norm=False,
                 fused_dropout_add_ln=False, residual_in_fp32=False, sequence_parallel=False,
                 mark_shared_params=False):
        super().__init__()
        mixer_cls = mixer_cls if mixer_cls is not None else partial(MHA, num_heads=dim // 64)
        mlp_cls = mlp_cls if mlp_cls is not None else partial(Mlp, hidden_features=4 * dim)
        self.tied_norm, self.residual_in_fp32 = tied_norm, residual_in_fp32
        self.layer_norm_fn = fused_add_norm_fn(fused_dropout_add_ln)
        self.fused_dropout_add_ln = self.layer_norm_fn is not None
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        self.dropout2 = dropout_cls(resid_dropout2)
        norms = [self.norm1]
        if not tied_norm:
            self.norm2 = norm_cls(dim)
            norms.append(self.norm2)
        _mark_params(norms, sequence_parallel, mark_shared_params)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, hidden_states1, hidden_states2=None, residual=None, mixer_kwargs=None):
        """-> (mixer output, mlp output, residual). The first block gets the embeddings as
        hidden_states1 and nothing else."""
        norm2 = self.norm1 if self.tied_norm else self.norm2
        if self.fused_dropout_add_ln:
            outs = self.layer_norm_fn(
                hidden_states1, self.norm1.weight, getattr(self.norm1, "bias", None),
                residual=residual, x1=hidden_states2,
                weight1=None if self.tied_norm else self.norm2.weight,
                bias1=None if self.tied_norm else getattr(self.norm2, "bias", None),
                eps=_norm_eps(self.norm1, hidden_states1.dtype),
                dropout_p=self.dropout1.p if self.training else 0.0, prenorm=True,
                residual_in_fp32=self.residual_in_fp32, is_rms_norm=_is_rms_norm(self.norm1))
            if self.tied_norm:
                hidden_states1, residual = outs
                hidden_states2 = hidden_states1
            else:
                hidden_states1, hidden_states2, residual = outs
        else:
            dropped = self.dropout1(hidden_states1)
            if hidden_states2 is not None:
                dropped = dropped + self.dropout2(hidden_states2)
            residual = dropped if residual is None else dropped + residual
            hidden_states1 = self.norm1(residual.to(dtype=self.norm1.weight.dtype))
            hidden_states2 = (hidden_states1 if self.tied_norm
                              else norm2(residual.to(dtype=norm2.weight.dtype)))
            if self.residual_in_fp32:
                residual = residual.float()
        hidden_states1 = self.mixer(hidden_states1, **(mixer_kwargs or {}))
        hidden_states2 = self.mlp(hidden_states2)
        return hidden_states1, hidden_states2, residual
