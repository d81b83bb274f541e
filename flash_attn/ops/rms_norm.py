"""Fused dropout + residual + RMSNorm: the functions of flash_attn.ops.layer_norm with
out = x / sqrt(mean(x^2) + eps) * weight (+ bias), on the same `dropout_layer_norm` kernels, with
the same dtypes and the same loading of the extension at the first call."""

import torch
from torch.nn import init

from flash_attn.ops.layer_norm import (
    DropoutAddLayerNormFn,
    DropoutAddLayerNormParallelResidualFn,
    _DropoutAddNorm,
)


def rms_norm(x, weight, epsilon):
    return DropoutAddLayerNormFn.apply(
        x, None, weight, None, None, None, 0.0, epsilon, False, False, True
    )


def dropout_add_rms_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None,
                         layerscale=None, prenorm=False, residual_in_fp32=False,
                         return_dropout_mask=False):
    """residual_in_fp32 only has an effect if residual is None; otherwise the residual stream has
    residual.dtype."""
    return DropoutAddLayerNormFn.apply(
        x0, residual, weight, bias, rowscale, layerscale, dropout_p, epsilon, residual_in_fp32,
        prenorm, True, return_dropout_mask,
    )


def dropout_add_rms_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale=None,
                                x0_subset=None, out_subset=None, rowscale_const=1.0,
                                out_numrows=0, prenorm=False, residual_in_fp32=False,
                                return_dropout_mask=False):
    return DropoutAddLayerNormFn.apply(
        x0, residual, weight, bias, None, layerscale, dropout_p, epsilon, residual_in_fp32,
        prenorm, True, return_dropout_mask, x0_subset, out_subset, rowscale_const, out_numrows,
    )


def dropout_add_rms_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1,
                                           dropout_p, epsilon, prenorm=False,
                                           residual_in_fp32=False, return_dropout_mask=False):
    return DropoutAddLayerNormParallelResidualFn.apply(
        x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, residual_in_fp32,
        prenorm, True, return_dropout_mask,
    )


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, **factory_kwargs))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        init.ones_(self.weight)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class DropoutAddRMSNorm(_DropoutAddNorm):
    is_rms_norm = True
