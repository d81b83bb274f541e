"""Fused dropout + residual + LayerNorm on the `dropout_layer_norm` CUDA extension.

    x = dropout(x0 * rowscale * layerscale) + residual      (the pre-norm sum, "residual" out)
    out = LayerNorm(x) * weight + bias                      (statistics in fp32)

Hidden sizes: multiples of 8 up to 8192. Dtypes are flash-attn's: input fp16 / bf16 / fp32, and
the output has the input dtype; the residual stream (x) has the residual's dtype (the input dtype
or fp32), or fp32 with residual_in_fp32 when there is no residual; weights (and layerscale) fp32
or the input dtype, and fp16 with fp32 input (fp16 weights with bf16 input are not supported);
weight gradients come back in the weight dtype; all arithmetic is fp32. The extension checks the
dtypes and names the argument it rejects. The dropout mask (uint8, 1 = kept) is saved for the
backward and returned on request. The extension is loaded at the first call, so importing this
module works without it; a call then raises MissingExtensionError (an ImportError) saying how
to build it.
"""

import torch
from torch.nn import init

from flash_attn._native import load_extension


def _ext():
    # Looked up at every call, as flash_attn_interface._cuda_ext does: a missing build fails the
    # call that needs it, never the import of this module (nor of flash_attn.ops.rms_norm).
    return load_extension("dropout_layer_norm")


def _prepare(t):
    """Contiguous and 16-byte aligned (the kernels move 16-byte vectors), or None."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _rows(t, hidden_size):
    return None if t is None else t.view(-1, hidden_size)


def _flat(t):
    return None if t is None else t.view(-1)


def _dropout_add_layer_norm_forward(x0, residual, gamma, beta, rowscale, colscale, x0_subset,
                                    out_subset, dropout_p, epsilon, rowscale_const, out_numrows,
                                    residual_in_fp32=False, is_rms_norm=False):
    """Arguments contiguous. Returns (z, x, dmask, mu, rsigma) as 2-D / 1-D tensors; x is x0
    itself when nothing changed it (no residual, dropout, scaling, subset or dtype change).
    Token dropping (x0_subset / out_subset given): row i of the residual stream takes x0 row
    x0_subset[i] - 1 (0: none) and writes output row out_subset[i] - 1 (0: none); x0 is then
    scaled by rowscale_const instead of rowscale."""
    # The hidden size is x0's last dimension, never gamma's length: the extension then rejects a
    # gamma of the wrong shape instead of x0 being silently regrouped into rows of gamma.numel().
    hidden_size = x0.shape[-1]
    x0mat = x0.view(-1, hidden_size)
    zmat, xmat, dmask, mu, rsigma = _ext().dropout_add_ln_fwd(
        x0mat, _rows(residual, hidden_size), gamma, beta, _flat(rowscale), colscale,
        _flat(x0_subset), _flat(out_subset), dropout_p, epsilon, rowscale_const, out_numrows,
        None, residual_in_fp32, is_rms_norm,
    )
    return zmat, (xmat if xmat is not None else x0mat), dmask, mu, rsigma


def _dropout_add_layer_norm_backward(dz, dx, x, x0, dmask, mu, rsigma, gamma, rowscale, colscale,
                                     x0_subset, out_subset, dropout_p, rowscale_const, x0_numrows,
                                     has_residual, is_rms_norm=False):
    """dx is the gradient of the pre-norm sum (None for post-norm); x0 is needed only for the
    gradient of colscale. Returns (dx0, dresidual, dgamma, dbeta, dcolscale or None)."""
    hidden_size = x.shape[-1]
    if colscale is not None:
        assert x0 is not None, "x0 is required to compute the gradient of colscale"
    dx0, dresidual, dgamma, dbeta, _, _, *rest = _ext().dropout_add_ln_bwd(
        dz.view(-1, hidden_size), _rows(dx, hidden_size), x.view(-1, hidden_size),
        _rows(x0, hidden_size), dmask, mu, rsigma, gamma, _flat(rowscale), colscale,
        _flat(x0_subset), _flat(out_subset), dropout_p, rowscale_const, x0_numrows, has_residual,
        is_rms_norm,
    )
    return dx0, dresidual, dgamma, dbeta, (rest[0] if colscale is not None else None)


def _dropout_add_layer_norm_parallel_residual_forward(x0, x1, residual, gamma0, beta0, gamma1,
                                                      beta1, dropout_p, epsilon,
                                                      residual_in_fp32=False, is_rms_norm=False):
    """x = dropout(x0) + dropout(x1) + residual; z0, z1 = LN(x) with (gamma0, beta0), (gamma1,
    beta1). Returns (z0, z1, x, dmask0, dmask1, mu, rsigma)."""
    hidden_size = x0.shape[-1]  # as in _dropout_add_layer_norm_forward
    x0mat = x0.view(-1, hidden_size)
    z0, z1, xmat, dmask0, dmask1, mu, rsigma = (
        _ext().dropout_add_ln_parallel_residual_fwd(
            x0mat, _rows(x1, hidden_size), _rows(residual, hidden_size), gamma0, beta0, gamma1,
            beta1, dropout_p, epsilon, None, residual_in_fp32, is_rms_norm,
        )
    )
    return z0, z1, (xmat if xmat is not None else x0mat), dmask0, dmask1, mu, rsigma


def _dropout_add_layer_norm_parallel_residual_backward(dz0, dz1, dx, x, dmask0, dmask1, mu,
                                                       rsigma, gamma0, gamma1, dropout_p, has_x1,
                                                       has_residual, is_rms_norm=False):
    hidden_size = x.shape[-1]
    xmat = x.view(-1, hidden_size)
    dx0, dx1, dresidual, dgamma0, dbeta0, dgamma1, dbeta1, *_ = (
        _ext().dropout_add_ln_parallel_residual_bwd(
            dz0.view(xmat.shape), _rows(dz1, hidden_size), _rows(dx, hidden_size), xmat, dmask0,
            dmask1, mu, rsigma, gamma0, gamma1, dropout_p, has_x1, has_residual, is_rms_norm,
        )
    )
    return dx0, dx1, dresidual, dgamma0, dbeta0, dgamma1, dbeta1


def _ones_mask(shape, device):
    return torch.ones(shape, dtype=torch.uint8, device=device)


class DropoutAddLayerNormFn(torch.autograd.Function):
    """The plain form (rowscale) and the token-dropping form (x0_subset / out_subset,
    rowscale_const, out_numrows) of dropout + add + LayerNorm / RMSNorm."""

    @staticmethod
    def forward(ctx, x0, residual, gamma, beta, rowscale, colscale, dropout_p, epsilon,
                residual_in_fp32=False, prenorm=False, is_rms_norm=False, return_dmask=False,
                x0_subset=None, out_subset=None, rowscale_const=1.0, out_numrows=0):
        x0, residual, gamma, beta, rowscale, colscale = map(
            _prepare, (x0, residual, gamma, beta, rowscale, colscale))
        x0_subset = x0_subset.contiguous() if x0_subset is not None else None
        out_subset = out_subset.contiguous() if out_subset is not None else None
        zmat, xmat, dmask, mu, rsigma = _dropout_add_layer_norm_forward(
            x0, residual, gamma, beta, rowscale, colscale, x0_subset, out_subset, dropout_p,
            epsilon, rowscale_const, out_numrows, residual_in_fp32, is_rms_norm,
        )
        # Rows of x and z: x0's rows without subsets, the subsets' otherwise.
        row_shape = (-1, *x0.shape[1:])
        # x0 is needed again only for the gradient of colscale.
        ctx.save_for_backward(xmat.view(row_shape), x0 if colscale is not None else None, dmask,
                              gamma, mu, rsigma, rowscale, colscale, x0_subset, out_subset)
        ctx.prenorm = prenorm
        ctx.dropout_p = dropout_p
        ctx.rowscale_const = rowscale_const
        ctx.x0_numrows = x0.shape[:-1].numel()
        ctx.has_residual = residual is not None
        ctx.is_rms_norm = is_rms_norm
        ctx.has_beta = beta is not None
        outputs = (zmat.view(row_shape),) + ((xmat.view(row_shape),) if prenorm else ())
        if return_dmask:
            mask = dmask.view(x0.shape) if dropout_p > 0.0 else _ones_mask(x0.shape, x0.device)
            ctx.mark_non_differentiable(mask)
            outputs += (mask,)
        return outputs[0] if len(outputs) == 1 else outputs

    @staticmethod
    def backward(ctx, dz, *args):
        dz = _prepare(dz)
        dx = _prepare(args[0]) if ctx.prenorm else None
        (x, x0, dmask, gamma, mu, rsigma, rowscale, colscale, x0_subset,
         out_subset) = ctx.saved_tensors
        dx0, dresidual, dgamma, dbeta, dcolscale = _dropout_add_layer_norm_backward(
            dz, dx, x, x0, dmask, mu, rsigma, gamma, rowscale, colscale, x0_subset, out_subset,
            ctx.dropout_p, ctx.rowscale_const, ctx.x0_numrows, ctx.has_residual, ctx.is_rms_norm,
        )
        return (
            dx0.view(-1, *x.shape[1:]),
            dresidual.view(x.shape) if dresidual is not None else None,
            dgamma,
            dbeta if ctx.has_beta else None,
            None,
            dcolscale,
            # dropout_p .. return_dmask, then the four subset arguments
            None, None, None, None, None, None, None, None, None, None,
        )


class DropoutAddLayerNormSubsetFn:
    """flash-attn's token-dropping Function under its name and argument order; the work is
    DropoutAddLayerNormFn's (which takes the subsets as trailing arguments)."""

    @staticmethod
    def apply(x0, residual, gamma, beta, colscale, x0_subset, out_subset, dropout_p, epsilon,
              rowscale_const, out_numrows, residual_in_fp32=False, prenorm=False,
              is_rms_norm=False, return_dmask=False):
        return DropoutAddLayerNormFn.apply(
            x0, residual, gamma, beta, None, colscale, dropout_p, epsilon, residual_in_fp32,
            prenorm, is_rms_norm, return_dmask, x0_subset, out_subset, rowscale_const, out_numrows)


class DropoutAddLayerNormParallelResidualFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x0, x1, residual, gamma0, beta0, gamma1, beta1, dropout_p, epsilon,
                residual_in_fp32=False, prenorm=False, is_rms_norm=False, return_dmask=False):
        x0, x1, residual, gamma0, beta0, gamma1, beta1 = map(
            _prepare, (x0, x1, residual, gamma0, beta0, gamma1, beta1))
        z0, z1, xmat, dmask0, dmask1, mu, rsigma = (
            _dropout_add_layer_norm_parallel_residual_forward(
                x0, x1, residual, gamma0, beta0, gamma1, beta1, dropout_p, epsilon,
                residual_in_fp32, is_rms_norm,
            )
        )
        ctx.save_for_backward(xmat.view(x0.shape), dmask0, dmask1, gamma0, gamma1, mu, rsigma)
        ctx.prenorm = prenorm
        ctx.dropout_p = dropout_p
        ctx.has_x1 = x1 is not None
        ctx.has_residual = residual is not None
        ctx.is_rms_norm = is_rms_norm
        ctx.has_beta = (beta0 is not None, beta1 is not None)
        outputs = (z0.view(x0.shape), z1.view(x0.shape) if z1 is not None else None)
        if prenorm:
            outputs += (xmat.view(x0.shape),)
        if return_dmask:
            keep = dropout_p > 0.0
            mask0 = dmask0.view(x0.shape) if keep else _ones_mask(x0.shape, x0.device)
            mask1 = (dmask1.view(x0.shape) if keep and x1 is not None
                     else _ones_mask(x0.shape, x0.device))
            ctx.mark_non_differentiable(mask0, mask1)
            outputs += (mask0, mask1)
        return outputs

    @staticmethod
    def backward(ctx, dz0, dz1, *args):
        dz0 = _prepare(dz0)
        dz1 = _prepare(dz1)
        dx = _prepare(args[0]) if ctx.prenorm else None
        x, dmask0, dmask1, gamma0, gamma1, mu, rsigma = ctx.saved_tensors
        dx0, dx1, dresidual, dgamma0, dbeta0, dgamma1, dbeta1 = (
            _dropout_add_layer_norm_parallel_residual_backward(
                dz0, dz1 if gamma1 is not None else None, dx, x, dmask0, dmask1, mu, rsigma,
                gamma0, gamma1, ctx.dropout_p, ctx.has_x1, ctx.has_residual, ctx.is_rms_norm,
            )
        )
        return (
            dx0.view(x.shape),
            dx1.view(x.shape) if dx1 is not None else None,
            dresidual.view(x.shape) if dresidual is not None else None,
            dgamma0,
            dbeta0 if ctx.has_beta[0] else None,
            dgamma1,
            dbeta1 if ctx.has_beta[1] else None,
            None, None, None, None, None, None,
        )


def layer_norm(x, weight, bias, epsilon):
    return DropoutAddLayerNormFn.apply(x, None, weight, bias, None, None, 0.0, epsilon, False)


def dropout_add_layer_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None,
                           layerscale=None, prenorm=False, residual_in_fp32=False,
                           return_dropout_mask=False):
    """residual_in_fp32 only has an effect if residual is None; otherwise the residual stream has
    residual.dtype. Returns out, plus the pre-norm sum if prenorm, plus the mask on request."""
    return DropoutAddLayerNormFn.apply(
        x0, residual, weight, bias, rowscale, layerscale, dropout_p, epsilon, residual_in_fp32,
        prenorm, False, return_dropout_mask,
    )


def dropout_add_layer_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale=None,
                                  x0_subset=None, out_subset=None, rowscale_const=1.0,
                                  out_numrows=0, prenorm=False, residual_in_fp32=False,
                                  return_dropout_mask=False):
    """Token dropping (drop path on whole sequences, or computing only some output rows): see
    _dropout_add_layer_norm_forward. residual_in_fp32 as in dropout_add_layer_norm."""
    return DropoutAddLayerNormFn.apply(
        x0, residual, weight, bias, None, layerscale, dropout_p, epsilon, residual_in_fp32,
        prenorm, False, return_dropout_mask, x0_subset, out_subset, rowscale_const, out_numrows,
    )


def dropout_add_layer_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1,
                                             dropout_p, epsilon, prenorm=False,
                                             residual_in_fp32=False, return_dropout_mask=False):
    """Parallel attention + MLP blocks (GPT-J, GPT-NeoX): returns (out0, out1) (out1 None
    without weight1), plus the pre-norm sum if prenorm, plus (dmask0, dmask1) on request."""
    return DropoutAddLayerNormParallelResidualFn.apply(
        x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, residual_in_fp32,
        prenorm, False, return_dropout_mask,
    )


class _DropoutAddNorm(torch.nn.Module):
    """Dropout + add + norm as a module: the LayerNorm form has a bias, the RMSNorm form
    (flash_attn.ops.rms_norm.DropoutAddRMSNorm) has none."""

    is_rms_norm = False

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False,
                 device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.prenorm = prenorm
        self.p = p
        self.eps = eps
        self.residual_in_fp32 = residual_in_fp32
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, **factory_kwargs))
        if self.is_rms_norm:
            self.register_parameter("bias", None)
        else:
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, **factory_kwargs))
        self.reset_parameters()

    @property
    def epsilon(self):  # the attribute's name in older flash-attn releases
        return self.eps

    def reset_parameters(self):
        init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x0, residual=None):
        return DropoutAddLayerNormFn.apply(
            x0, residual, self.weight, self.bias, None, None, self.p if self.training else 0.0,
            self.eps, self.residual_in_fp32, self.prenorm, self.is_rms_norm,
        )


class DropoutAddLayerNorm(_DropoutAddNorm):
    is_rms_norm = False
