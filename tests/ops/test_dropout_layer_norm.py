"""flash_attn.ops.layer_norm (and the `dropout_layer_norm` extension) against PyTorch references.

Every test runs twice: against the CUDA extension (GPU-marked) and, on CPU, against
`FakeDropoutLayerNorm`, a plain-PyTorch statement of the extension's contract, so that the autograd
wrappers (shapes, saved tensors, subsets, masks, return values) are checked in CPU CI too.
Error rule (DESIGN.md): our error against the fp32 reference is at most twice the error of the same
reference computed in the input dtype, plus a small absolute slack.
"""

import importlib
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F

ATOL = 1e-4


# --------------------------------------------------------------------------------------------
# The extension's contract in PyTorch (CPU)
# --------------------------------------------------------------------------------------------

def _norm_stats(x, epsilon, is_rms_norm):
    mu = torch.zeros(x.shape[0]) if is_rms_norm else x.mean(-1)
    xc = x if is_rms_norm else x - mu[:, None]
    return mu, torch.rsqrt(xc.square().mean(-1) + epsilon)


def _drop(t, dmask, dropout_p):
    return t if dmask is None else t * dmask.float() / (1.0 - dropout_p)


def _keep_mask(shape, dropout_p, gen):
    return (torch.rand(shape, generator=gen) >= dropout_p).to(torch.uint8)


class FakeDropoutLayerNorm:
    """dropout_add_ln_fwd / _bwd and the parallel-residual pair, computed in fp32 on CPU."""

    @staticmethod
    def _forward(x0, x1, residual, gammas, betas, rowscale, colscale, x0_subset, z_subset,
                 dropout_p, epsilon, rowscale_const, z_numrows, gen, residual_in_fp32,
                 is_rms_norm):
        itype = x0.dtype
        rtype = residual.dtype if residual is not None else (
            torch.float32 if residual_in_fp32 else itype)
        subset = x0_subset is not None
        rows, cols = (x0_subset.numel() if subset else x0.shape[0]), x0.shape[1]
        # The binding's shape check on the weights (check_tensor in csrc/layer_norm/ln_api.cpp).
        for names, ts in ((("gamma", "gamma1"), gammas), (("beta", "beta1"), betas)):
            for name, t in zip(names, ts):
                if t is not None and tuple(t.shape) != (cols,):
                    raise RuntimeError(f"dropout_layer_norm: {name} must have shape [{cols}], "
                                       f"got {list(t.shape)}")
        a = x0.float()
        if colscale is not None:
            a = a * colscale.float()
        if rowscale is not None:
            a = a * rowscale.float()[:, None]
        dmask = _keep_mask(x0.shape, dropout_p, gen) if dropout_p > 0 else None
        a = _drop(a, dmask, dropout_p)
        if subset:
            full = torch.zeros(rows, cols)
            src = x0_subset.long() - 1
            full[src >= 0] = a[src[src >= 0]] * rowscale_const
            a = full
        dmask1 = None
        if x1 is not None:
            dmask1 = _keep_mask(x1.shape, dropout_p, gen) if dropout_p > 0 else None
            a = a + _drop(x1.float(), dmask1, dropout_p)
        x = a + residual.float() if residual is not None else a
        mu, rs = _norm_stats(x, epsilon, is_rms_norm)
        xhat = (x - mu[:, None]) * rs[:, None]
        zs = []
        for gamma, beta in zip(gammas, betas):
            if gamma is None:
                zs.append(None)
                continue
            z = xhat * gamma.float() + (beta.float() if beta is not None else 0.0)
            if subset:
                out = torch.zeros(z_numrows, cols)
                dst = z_subset.long() - 1
                out[dst[dst >= 0]] = z[dst >= 0]
                z = out
            zs.append(z.to(itype))
        save_x = (residual is not None or x1 is not None or dropout_p > 0 or rowscale is not None
                  or colscale is not None or subset or rtype != itype)
        return zs, (x.to(rtype) if save_x else None), dmask, dmask1, mu, rs

    @staticmethod
    def dropout_add_ln_fwd(x0, residual, gamma, beta_, rowscale_, colscale_, x0_subset_,
                           z_subset_, dropout_p, epsilon, rowscale_const, z_numrows, gen_,
                           residual_in_fp32=False, is_rms_norm=False):
        (z,), x, dmask, _, mu, rs = FakeDropoutLayerNorm._forward(
            x0, None, residual, [gamma], [beta_], rowscale_, colscale_, x0_subset_, z_subset_,
            dropout_p, epsilon, rowscale_const, z_numrows, gen_, residual_in_fp32, is_rms_norm)
        return [z, x, dmask, mu, rs]

    @staticmethod
    def dropout_add_ln_parallel_residual_fwd(x0, x1_, residual, gamma0, beta0_, gamma1_, beta1_,
                                             dropout_p, epsilon, gen_, residual_in_fp32=False,
                                             is_rms_norm=False):
        (z0, z1), x, dmask0, dmask1, mu, rs = FakeDropoutLayerNorm._forward(
            x0, x1_, residual, [gamma0, gamma1_], [beta0_, beta1_], None, None, None, None,
            dropout_p, epsilon, 1.0, 0, gen_, residual_in_fp32, is_rms_norm)
        return [z0, z1, x, dmask0, dmask1, mu, rs]

    @staticmethod
    def _backward(dzs, gammas, dx, x, x0, dmask, dmask1, mu, rs, rowscale, colscale, x0_subset,
                  z_subset, dropout_p, rowscale_const, x0_numrows, has_x1, has_residual,
                  is_rms_norm):
        rows, cols = x.shape
        xhat = (x.float() - mu[:, None]) * rs[:, None]
        dy = torch.zeros(rows, cols)
        dgammas, dbetas = [], []
        for dz, gamma in zip(dzs, gammas):
            if dz is None:
                dgammas.append(None)
                dbetas.append(None)
                continue
            dz = dz.float()
            if z_subset is not None:
                full = torch.zeros(rows, cols)
                src = z_subset.long() - 1
                full[src >= 0] = dz[src[src >= 0]]
                dz = full
            dy += dz * gamma.float()
            dgammas.append((dz * xhat).sum(0).to(gamma.dtype))
            dbetas.append(dz.sum(0).to(gamma.dtype))
        c1 = (dy * xhat).mean(-1, keepdim=True)
        c2 = 0.0 if is_rms_norm else dy.mean(-1, keepdim=True)
        dt = rs[:, None] * (dy - c1 * xhat - c2)
        if dx is not None:
            dt = dt + dx.float()
        itype = dzs[0].dtype
        dx1 = _drop(dt, dmask1, dropout_p).to(itype) if has_x1 else None
        f = dt * rowscale_const if x0_subset is not None else dt
        if rowscale is not None:
            f = f * rowscale.float()[:, None]
        if x0_subset is not None:
            src = x0_subset.long() - 1
            g = torch.zeros(x0_numrows, cols)
            g[src[src >= 0]] = f[src >= 0]
            f = g
        f = _drop(f, dmask, dropout_p)
        dcolscale = None
        if colscale is not None:
            dcolscale = (f * x0.float()).sum(0).to(colscale.dtype)
            f = f * colscale.float()
        dresidual = dt.to(x.dtype) if has_residual else None
        return f.to(itype), dx1, dresidual, dgammas, dbetas, dcolscale

    @staticmethod
    def dropout_add_ln_bwd(dz, dx_, x, x0_, dmask_, mu, rsigma, gamma, rowscale_, colscale_,
                           x0_subset_, z_subset_, dropout_p, rowscale_const, x0_numrows,
                           has_residual, is_rms_norm=False):
        dx0, _, dres, (dgamma,), (dbeta,), dcolscale = FakeDropoutLayerNorm._backward(
            [dz], [gamma], dx_, x, x0_, dmask_, None, mu, rsigma, rowscale_, colscale_,
            x0_subset_, z_subset_, dropout_p, rowscale_const, x0_numrows, False, has_residual,
            is_rms_norm)
        parts = [dgamma.float()[None], dbeta.float()[None]]
        out = [dx0, dres, dgamma, dbeta] + parts
        return out + ([dcolscale, dcolscale.float()[None]] if colscale_ is not None else [])

    @staticmethod
    def dropout_add_ln_parallel_residual_bwd(dz0, dz1_, dx_, x, dmask0_, dmask1_, mu, rsigma,
                                             gamma0, gamma1_, dropout_p, has_x1, has_residual,
                                             is_rms_norm=False):
        dx0, dx1, dres, (dg0, dg1), (db0, db1), _ = FakeDropoutLayerNorm._backward(
            [dz0, dz1_], [gamma0, gamma1_], dx_, x, None, dmask0_, dmask1_, mu, rsigma, None,
            None, None, None, dropout_p, 1.0, 0, has_x1, has_residual, is_rms_norm)
        part = lambda t: t.float()[None] if t is not None else None  # noqa: E731
        return [dx0, dx1, dres, dg0, db0, dg1, db1, part(dg0), part(db0), part(dg1), part(db1)]


# --------------------------------------------------------------------------------------------
# Fixture: the wrappers on the real extension (GPU) or on the fake (CPU)
# --------------------------------------------------------------------------------------------

@pytest.fixture(params=["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def ln(request, monkeypatch):
    """A namespace with the layer_norm and rms_norm modules and the device they run on."""
    if request.param == "cuda":
        return types_ns("cuda")
    fake = types.ModuleType("dropout_layer_norm")
    for name in ("dropout_add_ln_fwd", "dropout_add_ln_bwd",
                 "dropout_add_ln_parallel_residual_fwd", "dropout_add_ln_parallel_residual_bwd"):
        setattr(fake, name, getattr(FakeDropoutLayerNorm, name))
    # The wrappers look the extension up at every call, so the fake in its place for the test's
    # duration is all it takes; monkeypatch puts the real one (or its absence) back.
    monkeypatch.setitem(sys.modules, "dropout_layer_norm", fake)
    return types_ns("cpu")


def types_ns(device):
    """The wrappers, on whichever `dropout_layer_norm` is importable when they are called."""
    return types.SimpleNamespace(mod=importlib.import_module("flash_attn.ops.layer_norm"),
                                 rms=importlib.import_module("flash_attn.ops.rms_norm"),
                                 device=device)


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------

def _assert_close(name, ours, ref, ref_lowp, atol=ATOL):
    """err <= 2 * base + slack. The slack grows with the magnitude: fp32 sums over many rows
    (weight gradients) differ by accumulation order alone, also where base is 0."""
    err = (ours.float() - ref.float()).abs().max().item()
    base = (ref_lowp.float() - ref.float()).abs().max().item()
    slack = atol + 1e-5 * ref.float().abs().max().item()
    assert err <= 2 * base + slack, f"{name}: error {err:.3g} > 2 * {base:.3g} + {slack:.3g}"


def _leaf(t, dtype=None):
    return None if t is None else t.detach().clone().to(dtype or t.dtype).requires_grad_()


def _backward_with_refs(targets, ref_sets):
    """Backward of our outputs and of each reference's with the same upstream gradients. They are
    drawn in the dtype of our outputs, as autograd hands them to the op, and widened exactly for
    the fp32 reference: an unrounded fp32 draw would make the fp32 reference the gradient for a
    different dz, and that difference (|dz - fp16(dz)| summed over rows, as large as an fp16 ulp
    of dgamma) would count as error of ours and of the low-precision reference alike."""
    grads = [torch.randn_like(t, dtype=torch.float32).to(t.dtype) for t in targets]
    torch.autograd.backward(targets, grads)
    for r in ref_sets:
        torch.autograd.backward(r, [g.to(o.dtype) for g, o in zip(grads, r)])


def reference(x0, residual, weight, bias, dropout_p, eps, rowscale=None, colscale=None,
              dmask=None, is_rms_norm=False, residual_dtype=None, fp32=True):
    """(out, pre-norm sum). fp32=True: everything in fp32. fp32=False: the input dtypes, the sum
    rounded to residual_dtype and normalised in the weight dtype promoted with the input dtype,
    as an unfused PyTorch would: the weight dtype, but fp32 for fp16 weights with fp32 input."""
    out_dtype = x0.dtype
    a = x0 * colscale if colscale is not None else x0
    if rowscale is not None:
        a = a * rowscale[:, None]
    if dmask is not None and dropout_p > 0:
        a = a * dmask.to(a.dtype) / (1.0 - dropout_p)
    if fp32:
        pre = a.float() + residual.float() if residual is not None else a.float()
        w, b = weight.float(), bias.float() if bias is not None else None
        xin = pre
    else:
        pre = (a.float() + residual.float() if residual is not None else a).to(residual_dtype)
        norm_dtype = torch.promote_types(weight.dtype, out_dtype)
        w, b = weight.to(norm_dtype), bias.to(norm_dtype) if bias is not None else None
        xin = pre.to(norm_dtype)
    if is_rms_norm:
        y = xin * torch.rsqrt(xin.float().square().mean(-1, keepdim=True) + eps).to(xin.dtype)
        out = y * w + b if b is not None else y * w
    else:
        out = F.layer_norm(xin, xin.shape[-1:], w, b, eps)
    return (out if fp32 else out.to(out_dtype)), pre


# --------------------------------------------------------------------------------------------
# dropout_add_layer_norm / dropout_add_rms_norm
# --------------------------------------------------------------------------------------------

def run_dropout_add_norm(ln, M, N, dtype, residual_dtype, weight_dtype, dropout_p,
                         has_residual=True, has_rowscale=False, has_colscale=False,
                         prenorm=True, is_rms_norm=False, has_bias=True, seed=0):
    torch.manual_seed(seed)
    dev = ln.device
    x0 = torch.randn(M, N, device=dev, dtype=dtype)
    residual = torch.randn(M, N, device=dev, dtype=residual_dtype) if has_residual else None
    weight = torch.randn(N, device=dev, dtype=weight_dtype)
    bias = torch.randn(N, device=dev, dtype=weight_dtype) if has_bias else None
    rowscale = torch.rand(M, device=dev, dtype=dtype) + 0.5 if has_rowscale else None
    colscale = torch.randn(N, device=dev, dtype=weight_dtype) if has_colscale else None
    residual_in_fp32 = not has_residual and residual_dtype == torch.float32
    inputs = [x0, residual, weight, bias, colscale]

    ours = [_leaf(t) for t in inputs]
    fn = ln.rms.dropout_add_rms_norm if is_rms_norm else ln.mod.dropout_add_layer_norm
    outs = fn(ours[0], ours[1], ours[2], ours[3], dropout_p, 1e-5, rowscale=rowscale,
              layerscale=ours[4], prenorm=prenorm, residual_in_fp32=residual_in_fp32,
              return_dropout_mask=True)
    out, dmask = outs[0], outs[-1]
    assert out.dtype == dtype and out.shape == x0.shape
    assert dmask.dtype == torch.uint8 and dmask.shape == x0.shape
    if dropout_p == 0.0:
        assert torch.all(dmask == 1)

    refs = {}
    for fp32 in (True, False):
        leaves = [_leaf(t, torch.float32 if fp32 else None) for t in inputs]
        r = reference(leaves[0], leaves[1], leaves[2], leaves[3], dropout_p, 1e-5,
                      rowscale=rowscale.float() if fp32 and rowscale is not None else rowscale,
                      colscale=leaves[4], dmask=dmask, is_rms_norm=is_rms_norm,
                      residual_dtype=residual_dtype, fp32=fp32)
        refs[fp32] = (leaves, r)
    _assert_close("out", out, refs[True][1][0], refs[False][1][0])
    targets = [out]
    if prenorm:
        pre = outs[1]
        assert pre.dtype == residual_dtype
        _assert_close("pre-norm sum", pre, refs[True][1][1], refs[False][1][1])
        targets.append(pre)

    _backward_with_refs(targets, [refs[fp32][1][: len(targets)] for fp32 in (True, False)])
    for name, t, r32, rlow in zip(["x0", "residual", "weight", "bias", "colscale"], ours,
                                  refs[True][0], refs[False][0]):
        if t is None:
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        _assert_close(f"grad {name}", t.grad, r32.grad, rlow.grad)
    return dmask


CPU_CASES = [
    dict(),
    dict(dropout_p=0.37, has_rowscale=True),
    dict(dropout_p=0.2, has_colscale=True, prenorm=False),
    dict(has_residual=False, residual_dtype=torch.float32, dropout_p=0.1),
    dict(is_rms_norm=True, has_bias=False, dropout_p=0.3),
    dict(is_rms_norm=True, has_colscale=True, has_rowscale=True),
    dict(weight_dtype=torch.float32, residual_dtype=torch.float32, prenorm=False),
]


@pytest.mark.parametrize("case", range(len(CPU_CASES)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dropout_add_norm_options(ln, case, dtype):
    kw = dict(residual_dtype=dtype, weight_dtype=dtype, dropout_p=0.0)
    kw.update(CPU_CASES[case])
    if dtype == torch.float32:
        kw.update(residual_dtype=torch.float32, weight_dtype=torch.float32)
    run_dropout_add_norm(ln, 37, 96, dtype, **kw)


TYPE_COMBOS = [  # (input, residual, weight)
    (torch.float32, torch.float32, torch.float32),
    (torch.float16, torch.float16, torch.float16),
    (torch.float16, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.float16, torch.float32, torch.float16),
    (torch.float32, torch.float32, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("N", [8, 192, 768, 1024, 1600, 2048, 3000, 4096, 5120, 8192])
@pytest.mark.parametrize("type_combo", TYPE_COMBOS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.37])
@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_dropout_add_norm_grid_gpu(N, type_combo, dropout_p, is_rms_norm):
    dtype, residual_dtype, weight_dtype = type_combo
    run_dropout_add_norm(types_ns("cuda"), 1031, N, dtype, residual_dtype, weight_dtype,
                         dropout_p, has_rowscale=dropout_p > 0, is_rms_norm=is_rms_norm)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("N", [256, 1536, 4096, 6144])
@pytest.mark.parametrize("type_combo", TYPE_COMBOS)
@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("has_colscale", [False, True])
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_dropout_add_norm_feature_grid_gpu(N, type_combo, has_residual, has_colscale, prenorm,
                                           is_rms_norm):
    dtype, residual_dtype, weight_dtype = type_combo
    run_dropout_add_norm(types_ns("cuda"), 2051, N, dtype, residual_dtype, weight_dtype, 0.2,
                         has_residual=has_residual, has_colscale=has_colscale, prenorm=prenorm,
                         is_rms_norm=is_rms_norm)


@pytest.mark.gpu
def test_many_rows_and_large_hidden_gpu():
    # More rows than the backward's persistent grid has slots, and the widest row.
    run_dropout_add_norm(types_ns("cuda"), 16384 + 7, 8192, torch.bfloat16, torch.float32,
                         torch.float32, 0.1, has_rowscale=True, has_colscale=True)


# --------------------------------------------------------------------------------------------
# Dropout masks
# --------------------------------------------------------------------------------------------

def test_dropout_mask_matches_zeros_and_reproduces(ln):
    M, N, p = 128, 256, 0.3
    x0 = torch.randn(M, N, device=ln.device) + 5.0  # no exact zeros
    w = torch.ones(N, device=ln.device)

    def run(seed):
        torch.manual_seed(seed)
        return ln.mod.dropout_add_layer_norm(x0, None, w, None, p, 1e-5, prenorm=True,
                                             return_dropout_mask=True)

    _, pre, dmask = run(7)
    assert torch.equal(pre == 0, dmask == 0)
    torch.testing.assert_close(pre[dmask == 1], x0[dmask == 1] / (1 - p))
    kept = dmask.float().mean().item()
    assert abs(kept - (1 - p)) < 0.01, kept
    _, pre2, dmask2 = run(7)
    assert torch.equal(dmask, dmask2) and torch.equal(pre, pre2)
    _, _, dmask3 = run(8)
    assert not torch.equal(dmask, dmask3)
    # Consecutive calls draw fresh masks.
    _, _, dmask4 = ln.mod.dropout_add_layer_norm(x0, None, w, None, p, 1e-5, prenorm=True,
                                                  return_dropout_mask=True)
    assert not torch.equal(dmask, dmask4)


def test_backward_zero_where_dropped(ln):
    torch.manual_seed(0)
    x0 = torch.randn(64, 128, device=ln.device, requires_grad=True)
    res = torch.randn(64, 128, device=ln.device, requires_grad=True)
    w = torch.randn(128, device=ln.device, requires_grad=True)
    out, dmask = ln.mod.dropout_add_layer_norm(x0, res, w, None, 0.5, 1e-5,
                                               return_dropout_mask=True)
    out.backward(torch.randn_like(out))
    assert torch.equal(x0.grad == 0, dmask == 0)
    assert torch.count_nonzero(res.grad == 0) == 0


@pytest.mark.gpu
def test_dropout_under_cuda_graph_replays_fresh_masks():
    layer_norm = importlib.import_module("flash_attn.ops.layer_norm")
    x0 = torch.randn(256, 512, device="cuda") + 5.0
    w = torch.ones(512, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph
        layer_norm.dropout_add_layer_norm(x0, None, w, None, 0.5, 1e-5, prenorm=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, pre, dmask = layer_norm.dropout_add_layer_norm(x0, None, w, None, 0.5, 1e-5,
                                                          prenorm=True, return_dropout_mask=True)
    graph.replay()
    first = dmask.clone()
    assert torch.equal(pre == 0, first == 0)
    graph.replay()
    assert not torch.equal(first, dmask)
    assert torch.equal(pre == 0, dmask == 0)


# --------------------------------------------------------------------------------------------
# Subset (token dropping) and parallel residual
# --------------------------------------------------------------------------------------------

def _droppath_subset(batch, seqlen, keep_prob, device):
    """Whole sequences kept with probability keep_prob: (kept batch mask, kept rows, 1-based
    running row index of every kept token, 0 for dropped ones)."""
    keep = torch.rand(batch) < keep_prob
    keep[0] = True
    rows = keep.repeat_interleave(seqlen)
    subset = torch.cumsum(rows, 0, dtype=torch.int32).masked_fill(~rows, 0)
    return keep.to(device), int(rows.sum()), subset.view(batch, seqlen).to(device)


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("has_colscale", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_dropout_add_layer_norm_subset(ln, prenorm, has_colscale, dropout_p):
    run_subset(ln, 8, 16, 64, torch.float32, prenorm, has_colscale, dropout_p)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [256, 1024, 3000, 8192])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float16, torch.float16),
                                                (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float16)])
@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_dropout_add_layer_norm_subset_gpu(N, dtype, weight_dtype, is_rms_norm):
    for prenorm in (False, True):
        run_subset(types_ns("cuda"), 8, 128, N, dtype, prenorm, True, 0.37, is_rms_norm,
                   weight_dtype)


def run_subset(ln, batch, seqlen, N, dtype, prenorm, has_colscale, dropout_p, is_rms_norm=False,
               weight_dtype=None):
    torch.manual_seed(0)
    dev = ln.device
    weight_dtype = weight_dtype or dtype
    drop_path_scale = 1 / 0.6
    x0_keep, x0_numrows, x0_subset = _droppath_subset(batch, seqlen, 0.6, dev)
    out_keep, out_numrows, out_subset = _droppath_subset(batch, seqlen, 0.6, dev)
    x0_full = torch.randn(batch, seqlen, N, device=dev, dtype=dtype)
    res = torch.randn(batch, seqlen, N, device=dev, dtype=dtype)
    weight = torch.randn(N, device=dev, dtype=weight_dtype)
    bias = torch.randn(N, device=dev, dtype=weight_dtype)
    colscale = torch.randn(N, device=dev, dtype=weight_dtype) if has_colscale else None

    x0 = _leaf(x0_full[x0_keep])
    ours = [_leaf(t) for t in (res, weight, bias, colscale)]
    fn = (ln.rms.dropout_add_rms_norm_subset if is_rms_norm
          else ln.mod.dropout_add_layer_norm_subset)
    outs = fn(x0, ours[0], ours[1], ours[2], dropout_p, 1e-5, layerscale=ours[3],
              x0_subset=x0_subset, out_subset=out_subset, rowscale_const=drop_path_scale,
              out_numrows=out_numrows, prenorm=prenorm, return_dropout_mask=True)
    out, dmask = outs[0], outs[-1]
    assert out.shape == (out_numrows // seqlen, seqlen, N) and out.dtype == dtype
    assert dmask.shape == x0.shape

    # Reference on the full batch: dropped sequences contribute zero, kept ones are scaled.
    dmask_full = torch.zeros(batch, seqlen, N, dtype=torch.uint8, device=dev)
    dmask_full[x0_keep] = dmask
    refs = {}
    for fp32 in (True, False):
        cast = torch.float32 if fp32 else None
        x0_ref = _leaf(x0_full, cast)
        leaves = [_leaf(t, cast) for t in (res, weight, bias, colscale)]
        scale = (x0_keep[:, None, None].to(x0_ref.dtype) * drop_path_scale)
        r_out, r_pre = reference(
            (x0_ref * scale).view(-1, N), leaves[0].view(-1, N), leaves[1], leaves[2], dropout_p,
            1e-5, colscale=leaves[3], dmask=dmask_full.view(-1, N), is_rms_norm=is_rms_norm,
            residual_dtype=dtype, fp32=fp32)
        r_out = r_out.view(batch, seqlen, N)[out_keep]
        r_pre = r_pre.view(batch, seqlen, N)
        refs[fp32] = (x0_ref, leaves, r_out, r_pre)
    _assert_close("out", out, refs[True][2], refs[False][2])
    targets = [out] + ([outs[1]] if prenorm else [])
    if prenorm:
        assert outs[1].shape == res.shape
        _assert_close("pre-norm sum", outs[1], refs[True][3], refs[False][3])
    _backward_with_refs(targets, [[refs[fp32][2]] + ([refs[fp32][3]] if prenorm else [])
                                  for fp32 in (True, False)])
    _assert_close("grad x0", x0.grad, refs[True][0].grad[x0_keep],
                  refs[False][0].grad[x0_keep])
    for name, t, r32, rlow in zip(["residual", "weight", "bias", "colscale"], ours,
                                  refs[True][1], refs[False][1]):
        if t is not None:
            _assert_close(f"grad {name}", t.grad, r32.grad, rlow.grad)


@pytest.mark.parametrize("has_x1", [False, True])
@pytest.mark.parametrize("tied_norm", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_dropout_add_layer_norm_parallel_residual(ln, has_x1, tied_norm, dropout_p):
    run_parallel(ln, 29, 64, torch.float32, has_x1, tied_norm, dropout_p, prenorm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [192, 1024, 2560, 6144, 8192])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float16, torch.float16),
                                                (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.float16)])
@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("prenorm", [False, True])
def test_dropout_add_layer_norm_parallel_residual_gpu(N, dtype, weight_dtype, is_rms_norm,
                                                      prenorm):
    for has_x1, tied_norm in ((True, False), (False, True)):
        run_parallel(types_ns("cuda"), 777, N, dtype, has_x1, tied_norm, 0.37, prenorm,
                     is_rms_norm, weight_dtype)


def run_parallel(ln, M, N, dtype, has_x1, tied_norm, dropout_p, prenorm, is_rms_norm=False,
                 weight_dtype=None):
    torch.manual_seed(0)
    dev = ln.device
    weight_dtype = weight_dtype or dtype
    t = lambda *s, dt=dtype: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    inputs = [t(M, N), t(M, N) if has_x1 else None, t(M, N), t(N, dt=weight_dtype),
              t(N, dt=weight_dtype), None if tied_norm else t(N, dt=weight_dtype),
              None if tied_norm else t(N, dt=weight_dtype)]
    ours = [_leaf(x) for x in inputs]
    fn = (ln.rms.dropout_add_rms_norm_parallel_residual if is_rms_norm
          else ln.mod.dropout_add_layer_norm_parallel_residual)
    outs = fn(*ours, dropout_p, 1e-5, prenorm=prenorm, return_dropout_mask=True)
    out0, out1 = outs[0], outs[1]
    dmask0, dmask1 = outs[-2], outs[-1]
    assert (out1 is None) == tied_norm
    if not has_x1 or dropout_p == 0:
        assert torch.all(dmask1 == 1)

    refs = {}
    for fp32 in (True, False):
        cast = torch.float32 if fp32 else None
        leaves = [_leaf(x, cast) for x in inputs]
        x = leaves[0]
        if dropout_p > 0:
            x = x * dmask0.to(x.dtype) / (1 - dropout_p)
        if has_x1:
            x1 = leaves[1]
            if dropout_p > 0:
                x1 = x1 * dmask1.to(x1.dtype) / (1 - dropout_p)
            x = x + x1
        r0, pre = reference(x, leaves[2], leaves[3], leaves[4], 0.0, 1e-5,
                            is_rms_norm=is_rms_norm, residual_dtype=dtype, fp32=fp32)
        r1 = None
        if not tied_norm:
            r1, _ = reference(x, leaves[2], leaves[5], leaves[6], 0.0, 1e-5,
                              is_rms_norm=is_rms_norm, residual_dtype=dtype, fp32=fp32)
        refs[fp32] = (leaves, [r for r in (r0, r1) if r is not None] + ([pre] if prenorm else []))
    targets = [o for o in (out0, out1) if o is not None] + ([outs[2]] if prenorm else [])
    for k, o in enumerate(targets):
        _assert_close(f"output {k}", o, refs[True][1][k], refs[False][1][k])
    _backward_with_refs(targets, [refs[fp32][1] for fp32 in (True, False)])
    names = ["x0", "x1", "residual", "weight0", "bias0", "weight1", "bias1"]
    for name, o, r32, rlow in zip(names, ours, refs[True][0], refs[False][0]):
        if o is not None:
            _assert_close(f"grad {name}", o.grad, r32.grad, rlow.grad)


@pytest.mark.parametrize("has_bias0,has_bias1", [(True, False), (False, True)])
def test_parallel_residual_bias_on_one_branch(ln, has_bias0, has_bias1):
    # Each bias gets its own gradient, or none when it is not given.
    torch.manual_seed(0)
    t = lambda *s: torch.randn(*s, device=ln.device)  # noqa: E731
    x0, res, w0, w1 = t(9, 32), t(9, 32), t(32), t(32)
    b0, b1 = (t(32) if has_bias0 else None), (t(32) if has_bias1 else None)
    ours = [_leaf(v) for v in (x0, res, w0, b0, w1, b1)]
    out0, out1 = ln.mod.dropout_add_layer_norm_parallel_residual(
        ours[0], None, ours[1], ours[2], ours[3], ours[4], ours[5], 0.0, 1e-5)
    refs = [_leaf(v) for v in (x0, res, w0, b0, w1, b1)]
    pre = refs[0] + refs[1]
    ref0 = F.layer_norm(pre, (32,), refs[2], refs[3], 1e-5)
    ref1 = F.layer_norm(pre, (32,), refs[4], refs[5], 1e-5)
    g0, g1 = t(9, 32), t(9, 32)
    torch.autograd.backward([out0, out1], [g0, g1])
    torch.autograd.backward([ref0, ref1], [g0, g1])
    for name, o, r in zip(["x0", "residual", "weight0", "bias0", "weight1", "bias1"], ours, refs):
        if o is None:
            continue
        assert o.grad is not None, name
        torch.testing.assert_close(o.grad, r.grad, atol=1e-4, rtol=1e-4, msg=name)


# --------------------------------------------------------------------------------------------
# Modules, plain norms and bad inputs
# --------------------------------------------------------------------------------------------

def test_layer_norm_and_module(ln):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, device=ln.device)
    norm = ln.mod.DropoutAddLayerNorm(64, prenorm=True, p=0.5, device=ln.device)
    assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0) and norm.epsilon == norm.eps
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    res = torch.randn_like(x)
    norm.eval()  # no dropout in eval
    out, pre = norm(x, res)
    torch.testing.assert_close(pre, x + res)
    torch.testing.assert_close(out, F.layer_norm(x + res, (64,), norm.weight, norm.bias, 1e-5),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ln.mod.layer_norm(x, norm.weight, norm.bias, 1e-5),
                               F.layer_norm(x, (64,), norm.weight, norm.bias, 1e-5),
                               atol=1e-5, rtol=1e-5)


def test_weight_of_another_length_is_an_error(ln):
    # The hidden size is x0's last dimension: a weight of another length must be rejected, not
    # taken as the hidden size with x0 regrouped into rows of that length ((4, 64) -> (8, 32)).
    x = torch.randn(4, 64, device=ln.device)
    w = torch.randn(64, device=ln.device)
    with pytest.raises(RuntimeError, match="gamma must have shape"):
        ln.mod.dropout_add_layer_norm(x, None, w[:32], None, 0.0, 1e-5)
    with pytest.raises(RuntimeError, match="beta must have shape"):
        ln.mod.dropout_add_layer_norm(x, None, w, w[:32], 0.0, 1e-5)
    with pytest.raises(RuntimeError, match="gamma must have shape"):
        ln.mod.dropout_add_layer_norm_parallel_residual(x, None, None, w[:32], None, None, None,
                                                        0.0, 1e-5)


@pytest.mark.gpu
def test_bad_inputs_name_the_argument_gpu():
    ext = importlib.import_module("flash_attn._native").load_extension("dropout_layer_norm")
    layer_norm = importlib.import_module("flash_attn.ops.layer_norm")
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="hidden_size .* multiple of 8"):
        layer_norm.dropout_add_layer_norm(x[:, :60], None, w[:60], None, 0.0, 1e-5)
    with pytest.raises(RuntimeError, match="hidden_size .* at most 8192"):
        big = torch.randn(2, 8200, device="cuda")
        layer_norm.dropout_add_layer_norm(big, None, torch.ones(8200, device="cuda"), None, 0.0,
                                          1e-5)
    # flash-attn's dtype table: fp16 weights go with fp32 or fp16 input, not bf16; fp32 input
    # takes fp32 or fp16 weights and an fp32 residual only.
    rejected = [  # (x0, residual, weight, message)
        (x, None, w.half(), "gamma must have dtype BFloat16 or Float with BFloat16 input, "
                            "got Half"),
        (x.float(), None, w, "gamma must have dtype Float or Half with Float input, got BFloat16"),
        (x.float(), x.half(), w.float(), "residual must have dtype Float with Float input, "
                                         "got Half"),
    ]
    for x0, residual, weight, message in rejected:
        with pytest.raises(RuntimeError, match=message):
            layer_norm.dropout_add_layer_norm(x0, residual, weight, None, 0.0, 1e-5)
    with pytest.raises(RuntimeError, match="gamma must have shape"):
        layer_norm.dropout_add_layer_norm(x, None, w[:32], None, 0.0, 1e-5)
    with pytest.raises(RuntimeError, match="residual must have shape"):
        layer_norm.dropout_add_layer_norm(x, x[:2], w, None, 0.0, 1e-5)
    with pytest.raises(RuntimeError, match="x0 must be a CUDA tensor"):
        layer_norm.dropout_add_layer_norm(x.cpu(), None, w, None, 0.0, 1e-5)
    with pytest.raises(RuntimeError, match="dropout_p must be in"):
        layer_norm.dropout_add_layer_norm(x, None, w, None, 1.0, 1e-5)
    with pytest.raises(RuntimeError, match="x0 must be float32, float16 or bfloat16"):
        ext.dropout_add_ln_fwd(x.double(), None, w.double(), None, None, None, None, None, 0.0,
                               1e-5, 1.0, 0, None)
    with pytest.raises(RuntimeError, match="x0_subset and z_subset must be given together"):
        ext.dropout_add_ln_fwd(x, None, w, None, None, None,
                               torch.ones(4, dtype=torch.int32, device="cuda"), None, 0.0, 1e-5,
                               1.0, 4, None)
    with pytest.raises(RuntimeError, match="dmask is required"):
        z, xs, dmask, mu, rs = ext.dropout_add_ln_fwd(x, None, w, None, None, None, None, None,
                                                      0.1, 1e-5, 1.0, 0, None)
        ext.dropout_add_ln_bwd(z, None, xs, None, None, mu, rs, w, None, None, None, None, 0.1,
                               1.0, 0, False)


@pytest.fixture
def modules_without_extension(monkeypatch):
    """Fresh imports of flash_attn.ops.layer_norm and .rms_norm where `dropout_layer_norm` cannot
    be imported (also on a machine where it is built); monkeypatch puts everything back."""
    import flash_attn.ops as ops

    for name in ("layer_norm", "rms_norm"):
        importlib.import_module(f"flash_attn.ops.{name}")
        monkeypatch.delitem(sys.modules, f"flash_attn.ops.{name}")
        monkeypatch.setattr(ops, name, getattr(ops, name, None), raising=False)
    monkeypatch.setitem(sys.modules, "dropout_layer_norm", None)  # import of it fails
    return types.SimpleNamespace(mod=importlib.import_module("flash_attn.ops.layer_norm"),
                                 rms=importlib.import_module("flash_attn.ops.rms_norm"))


def test_modules_import_without_the_extension(modules_without_extension):
    from flash_attn._native import extension_available

    assert not extension_available("dropout_layer_norm")
    # The fixture's imports succeeded; what they return is usable without the extension.
    assert modules_without_extension.mod.DropoutAddLayerNorm(64).weight.shape == (64,)
    assert modules_without_extension.rms.RMSNorm(64).bias is None


_X, _W = torch.linspace(-1.0, 1.0, 256).view(4, 64), torch.ones(64)
_SUBSET = torch.ones(4, dtype=torch.int32)
CALLS_WITHOUT_EXTENSION = {
    "dropout_add_layer_norm": lambda m: m.mod.dropout_add_layer_norm(_X, _X, _W, None, 0.0, 1e-5),
    "dropout_add_layer_norm_subset": lambda m: m.mod.dropout_add_layer_norm_subset(
        _X, _X, _W, None, 0.0, 1e-5, x0_subset=_SUBSET, out_subset=_SUBSET, out_numrows=1),
    "dropout_add_layer_norm_parallel_residual": (
        lambda m: m.mod.dropout_add_layer_norm_parallel_residual(_X, _X, _X, _W, None, _W, None,
                                                                 0.0, 1e-5)),
    "DropoutAddLayerNorm": lambda m: m.mod.DropoutAddLayerNorm(64)(_X, _X),
    "rms_norm": lambda m: m.rms.rms_norm(_X, _W, 1e-5),
    "dropout_add_rms_norm": lambda m: m.rms.dropout_add_rms_norm(_X, _X, _W, None, 0.0, 1e-5),
    "RMSNorm": lambda m: m.rms.RMSNorm(64)(_X),
}


@pytest.mark.parametrize("call", list(CALLS_WITHOUT_EXTENSION))
def test_call_without_the_extension_says_how_to_build(modules_without_extension, call):
    from flash_attn._native import BUILD_HINT, MissingExtensionError

    missing = re.escape("`dropout_layer_norm` is not built") + ".*" + re.escape(BUILD_HINT)
    with pytest.raises(MissingExtensionError, match=missing):
        CALLS_WITHOUT_EXTENSION[call](modules_without_extension)
