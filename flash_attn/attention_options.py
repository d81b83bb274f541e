"""The scalar options of one attention call, as one object from the public functions to the kernel.

The torch.library ops take schema-typed arguments, so an AttentionOptions crosses an op boundary
as its fields in declaration order: `op_args` flattens it, `from_op_args` rebuilds it inside the
op, and OP_SCHEMA is the matching part of the ops' schemas (flash_attn/attention_ops.py). Adding
an option is a field here with its check in `create`, the keyword of the public functions that
offer it, and what the kernel does with it (the binding's argument: the extension calls in
attention_ops.py and flash_api.cpp); the autograd Functions, the ops' schemas and their fake
implementations carry it unchanged. Tensor-valued options (alibi_slopes) are op arguments of
their own.
"""

import dataclasses
from typing import Optional

from flash_attn.attention_checks import _fail


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    dropout_p: float = 0.0  # probability of dropping an attention weight (training only)
    # Scale of q k^T; None means 1/sqrt(head_dim) of the caller's (unpadded) inputs. It crosses an
    # op boundary resolved (op_args), so inside the ops it is always a float.
    softmax_scale: Optional[float] = None
    causal: bool = False
    # The window as the caller gave it, -1 meaning unbounded: the binding folds causal in and
    # drops a side that reaches past every key (set_common_params in flash_api.cpp, the one place).
    window_size_left: int = -1
    window_size_right: int = -1
    softcap: float = 0.0  # > 0: score = softcap * tanh(score / softcap)
    deterministic: bool = False  # the backward's dq is summed in a fixed order
    return_attn_probs: bool = False  # also return softmax_lse and S_dmask

    @classmethod
    def create(cls, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
               softcap=0.0, deterministic=False, return_attn_probs=False):
        """The options of a public call, each checked (ValueError naming the argument)."""
        if not 0.0 <= dropout_p < 1.0:
            _fail("dropout_p", "in [0, 1)", dropout_p)
        if not softcap >= 0.0:  # also rejects NaN
            _fail("softcap", ">= 0", softcap)
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or any(isinstance(w, bool) or int(w) != w or w < -1 for w in window_size)):
            _fail("window_size", "a pair (left, right) of ints >= -1 (-1: unbounded)", window_size)
        return cls(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=bool(causal),
                   window_size_left=int(window_size[0]), window_size_right=int(window_size[1]),
                   softcap=softcap, deterministic=bool(deterministic),
                   return_attn_probs=bool(return_attn_probs))

    @property
    def return_softmax(self):
        """Whether the kernel writes S_dmask: only with dropout (flash-attn returns an empty
        S_dmask without it, since S_dmask encodes the dropout mask)."""
        return self.return_attn_probs and self.dropout_p > 0

    def op_args(self, head_dim):
        """The fields in declaration order, softmax_scale resolved for this (unpadded) head dim:
        the arguments that OP_SCHEMA declares."""
        scale = head_dim ** (-0.5) if self.softmax_scale is None else self.softmax_scale
        return tuple(scale if name == "softmax_scale" else getattr(self, name)
                     for name in _FIELD_NAMES)

    @classmethod
    def from_op_args(cls, args):
        return cls(*args)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(AttentionOptions))
# The schema type of each field as an op argument (softmax_scale arrives resolved).
_SCHEMA_TYPES = {float: "float", Optional[float]: "float", bool: "bool", int: "SymInt"}
OP_SCHEMA = ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}"
                      for f in dataclasses.fields(AttentionOptions))
