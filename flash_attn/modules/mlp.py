"""Feed-forward blocks: Mlp (fc1 -> activation -> fc2), GatedMlp (GLU family: SwiGLU, GeGLU, ...),
and their tensor-parallel forms (fc1 column-parallel, fc2 row-parallel)."""

import torch.nn as nn
import torch.nn.functional as F

from flash_attn.modules.mha import import_optional


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.gelu,
                 bias1=True, bias2=True, return_residual=False, device=None, dtype=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x):
        y = self.fc2(self.activation(self.fc1(x)))
        return y if not self.return_residual else (y, x)


def _gated_hidden(in_features, hidden_features, multiple_of):
    hidden = hidden_features if hidden_features is not None else int(8 * in_features / 3)
    return (hidden + multiple_of - 1) // multiple_of * multiple_of


def _gate(y, activation):
    """fc1 output (..., 2 * hidden): the first half is the value, the second the gate."""
    if activation is F.sigmoid:  # plain GLU has its own kernel
        return F.glu(y, dim=-1)
    value, gate = y.chunk(2, dim=-1)
    return value * activation(gate)


class GatedMlp(nn.Module):
    """fc2(value * activation(gate)), with [value, gate] = fc1(x). activation F.silu is SwiGLU,
    F.gelu GeGLU, F.sigmoid GLU. hidden_features (default 8/3 in_features) is rounded up to a
    multiple of multiple_of."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.sigmoid,
                 bias1=True, bias2=True, multiple_of=128, return_residual=False, device=None,
                 dtype=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden_features = _gated_hidden(in_features, hidden_features, multiple_of)
        self.return_residual, self.activation = return_residual, activation
        self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=bias1, **factory)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x):
        y = self.fc2(_gate(self.fc1(x), self.activation))
        return y if not self.return_residual else (y, x)


class ParallelMLP(nn.Module):
    """Mlp whose hidden units are split over process_group. With sequence_parallel the input
    and output are this rank's slice of the (batch * seqlen) rows."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.gelu,
                 process_group=None, sequence_parallel=True, bias1=True, bias2=True,
                 device=None, dtype=None):
        from flash_attn.ops.fused_dense import ColumnParallelLinear, RowParallelLinear

        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if process_group is None:
            raise ValueError("ParallelMLP needs a process_group")
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.activation = activation
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1,
                                        sequence_parallel=sequence_parallel, **factory)
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory)

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x)))


class ParallelGatedMlp(nn.Module):
    """GatedMlp split over process_group: each rank's fc1 rows are [its value units; its gate
    units] (shard_state_dict_tp arranges checkpoints that way)."""

    def __init__(self, in_features, process_group, hidden_features=None, out_features=None,
                 activation=F.sigmoid, bias1=True, bias2=True, multiple_of=128,
                 sequence_parallel=True, device=None, dtype=None):
        from flash_attn.ops.fused_dense import ColumnParallelLinear, RowParallelLinear

        factory = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden_features = _gated_hidden(in_features, hidden_features, multiple_of)
        self.activation = activation
        self.fc1 = ColumnParallelLinear(in_features, 2 * hidden_features, process_group,
                                        bias=bias1, sequence_parallel=sequence_parallel,
                                        multiple_of=2 * multiple_of, **factory)
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, multiple_of=multiple_of,
                                     **factory)

    def forward(self, x):
        return self.fc2(_gate(self.fc1(x), self.activation))


def fused_mlp_cls():
    """flash_attn.ops.fused_dense.FusedMLP, or None when it is unavailable."""
    return import_optional("flash_attn.ops.fused_dense", "FusedMLP")

