"""Triton dropout + residual + LayerNorm / RMSNorm against the PyTorch references.

Error rule (DESIGN.md): our error against the fp32 reference is at most twice the error of the
same reference computed in the input dtype, plus a small absolute slack. On CPU the kernels run in
the Triton interpreter on small shapes; the full option grid runs on the GPU.
"""

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flash_attn.ops.triton import layer_norm as ln
from flash_attn.ops.triton.layer_norm import (
    LayerNorm,
    RMSNorm,
    layer_norm_fn,
    layer_norm_linear_fn,
    layer_norm_ref,
    rms_norm_fn,
    rms_norm_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 1e-4


def _assert_close(name, ours, ref, ref_lowp, atol=ATOL):
    """err <= 2 * base + slack. The slack grows with the magnitude: fp32 sums over many rows
    (weight gradients) differ by accumulation order alone, also where base is 0."""
    err = (ours.float() - ref.float()).abs().max().item()
    base = (ref_lowp.float() - ref.float()).abs().max().item()
    slack = atol + 1e-5 * ref.float().abs().max().item()
    assert err <= 2 * base + slack, f"{name}: error {err:.3g} > 2 * {base:.3g} + {slack:.3g}"


def _leaf(t):
    return t.detach().clone().requires_grad_()


def run_case(M, N, dtype, weight_dtype=None, is_rms_norm=False, has_bias=True,
             residual_dtype=None, residual_in_fp32=False, dropout_p=0.0, has_rowscale=False,
             prenorm=False, has_x1=False, has_weight1=False, zero_centered_weight=False,
             out_dtype=None, seed=0):
    """One forward + backward of layer_norm_fn against the references, every output and grad.
    residual_dtype None: no residual."""
    torch.manual_seed(seed)
    weight_dtype = weight_dtype or dtype
    dev = DEVICE
    x = torch.randn(M, N, device=dev, dtype=dtype)
    weight = torch.randn(N, device=dev, dtype=weight_dtype)
    bias = torch.randn(N, device=dev, dtype=weight_dtype) if has_bias else None
    residual = (torch.randn(M, N, device=dev, dtype=residual_dtype)
                if residual_dtype is not None else None)
    x1 = torch.randn(M, N, device=dev, dtype=dtype) if has_x1 else None
    weight1 = torch.randn(N, device=dev, dtype=weight_dtype) if has_weight1 else None
    bias1 = torch.randn(N, device=dev, dtype=weight_dtype) if has_weight1 and has_bias else None
    rowscale = torch.rand(M, device=dev, dtype=dtype) + 0.5 if has_rowscale else None
    inputs = [x, weight, bias, residual, x1, weight1, bias1]

    ours_in = [_leaf(t) if t is not None else None for t in inputs]
    outs = layer_norm_fn(
        *ours_in, eps=1e-5, dropout_p=dropout_p, rowscale=rowscale, prenorm=prenorm,
        residual_in_fp32=residual_in_fp32, zero_centered_weight=zero_centered_weight,
        is_rms_norm=is_rms_norm, return_dropout_mask=True, out_dtype=out_dtype,
    )
    outs = list(outs)
    mask, mask1 = outs[-2], outs[-1]
    outs = outs[:-2]
    if dropout_p > 0.0:
        assert mask.dtype == torch.bool and mask.shape == x.shape
        assert (mask1 is not None) == has_x1
    else:
        assert mask is None and mask1 is None

    ref_fn = rms_norm_ref if is_rms_norm else layer_norm_ref
    # refs[True]: everything in fp32 (the outputs stay fp32); refs[False]: the input dtypes.
    refs = {}
    for fp32 in (True, False):
        cast = (lambda t: t.float()) if fp32 else (lambda t: t)  # noqa: E731
        ref_in = [_leaf(cast(t)) if t is not None else None for t in inputs]
        r = ref_fn(*ref_in, eps=1e-5, dropout_p=dropout_p,
                   rowscale=cast(rowscale) if rowscale is not None else None, prenorm=prenorm,
                   zero_centered_weight=zero_centered_weight, dropout_mask=mask,
                   dropout_mask1=mask1)
        refs[fp32] = (ref_in, list(r) if isinstance(r, tuple) else [r])

    assert len(outs) == len(refs[True][1]) == 1 + has_weight1 + prenorm
    expected_out_dtype = out_dtype or dtype
    assert outs[0].dtype == expected_out_dtype
    if prenorm:
        res_dtype = residual_dtype or (torch.float32 if residual_in_fp32 else dtype)
        assert outs[-1].dtype == res_dtype
    for k, o in enumerate(outs):
        _assert_close(f"output {k}", o, refs[True][1][k], refs[False][1][k])

    # Upstream gradients in our outputs' dtype (as autograd hands them to the op), widened exactly
    # for the fp32 reference: otherwise the reference is the gradient of a different dz.
    grads = [torch.randn_like(o, dtype=torch.float32).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    for fp32 in (True, False):
        ref_outs = refs[fp32][1]
        torch.autograd.backward(ref_outs, [g.to(o.dtype) for g, o in zip(grads, ref_outs)])
    names = ["x", "weight", "bias", "residual", "x1", "weight1", "bias1"]
    for name, t, r32, rlow in zip(names, ours_in, refs[True][0], refs[False][0]):
        if t is None:
            continue
        assert t.grad is not None, f"no gradient for {name}"
        assert t.grad.dtype == t.dtype, f"{name}.grad dtype {t.grad.dtype} != {t.dtype}"
        _assert_close(f"grad {name}", t.grad, r32.grad, rlow.grad)
    return mask, mask1, {name: t.grad for name, t in zip(names, ours_in) if t is not None}


# A covering set of option combinations, small enough for the interpreter on CPU.
CPU_CASES = [
    dict(),
    dict(is_rms_norm=True, has_bias=False),
    dict(residual_dtype=torch.float32, prenorm=True),
    dict(residual_in_fp32=True, prenorm=True, dropout_p=0.25),
    dict(dropout_p=0.37, has_rowscale=True, residual_dtype="same", prenorm=True),
    dict(has_x1=True, has_weight1=True, residual_dtype="same", dropout_p=0.2, prenorm=True),
    dict(has_x1=True, is_rms_norm=True, zero_centered_weight=True),
    dict(has_weight1=True, zero_centered_weight=True, has_bias=False),
    dict(weight_dtype=torch.float32, residual_dtype=torch.float32, out_dtype=torch.float32),
    dict(is_rms_norm=True, dropout_p=0.1, has_rowscale=True, prenorm=True),
]


def _resolve(case, dtype):
    case = dict(case)
    if case.get("residual_dtype") == "same":
        case["residual_dtype"] = dtype
    return case


# bf16 runs on the GPU only: the Triton interpreter (3.9) truncates fp32 -> bf16 on store instead
# of rounding to nearest, so its bf16 outputs are up to one ulp off the correctly rounded ones.
LOW_PRECISION = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("N", [96, 257])
@pytest.mark.parametrize("dtype", [torch.float32] + LOW_PRECISION)
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_layer_norm_options(case, dtype, N):
    run_case(19, N, dtype, **_resolve(CPU_CASES[case], dtype))


DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float16, torch.float16),
               (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


# Each new (dtype, flags, block size) combination is a Triton compile: the default GPU grid keeps
# two hidden sizes, the slow one adds the rest.
@pytest.mark.gpu
@pytest.mark.parametrize("N", [1000, 4096] + [pytest.param(n, marks=pytest.mark.slow)
                                             for n in (192, 2048, 5120, 8192)])
@pytest.mark.parametrize("dtype,weight_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("residual", [None, "same", torch.float32])
@pytest.mark.parametrize("dropout_p", [0.0, 0.37])
def test_layer_norm_grid_gpu(N, dtype, weight_dtype, is_rms_norm, residual, dropout_p):
    run_case(517, N, dtype, weight_dtype, is_rms_norm=is_rms_norm,
             residual_dtype=dtype if residual == "same" else residual, dropout_p=dropout_p,
             prenorm=True)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=5)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_feature_grid_gpu(flags, dtype):
    has_rowscale, has_x1, has_weight1, zero_centered, residual_in_fp32 = flags
    if has_rowscale and has_x1:
        pytest.skip("rowscale is not supported together with x1")
    run_case(333, 1536, dtype, has_rowscale=has_rowscale, has_x1=has_x1,
             has_weight1=has_weight1, zero_centered_weight=zero_centered,
             residual_in_fp32=residual_in_fp32, dropout_p=0.2, prenorm=True)


def test_rms_norm_fn_matches_layer_norm_fn_flag():
    torch.manual_seed(0)
    x = torch.randn(7, 40, device=DEVICE)
    w = torch.randn(40, device=DEVICE)
    y = rms_norm_fn(x, w, None, eps=1e-5)
    assert torch.equal(y, layer_norm_fn(x, w, None, eps=1e-5, is_rms_norm=True))
    _assert_close("rms", y, rms_norm_ref(x, w, None, eps=1e-5), rms_norm_ref(x, w, None, eps=1e-5))


def test_dropout_mask_matches_zeros_and_reproduces():
    torch.manual_seed(0)
    M, N, p = 64, 256, 0.3
    x = torch.randn(M, N, device=DEVICE) + 5.0  # no exact zeros
    w = torch.ones(N, device=DEVICE)

    def run():
        return layer_norm_fn(x, w, None, dropout_p=p, prenorm=True, return_dropout_mask=True)

    torch.manual_seed(123)
    y, pre, mask, mask1 = run()
    assert mask1 is None
    # The pre-norm sum is x * mask / (1 - p): zero exactly where the mask drops.
    assert torch.equal(pre == 0, ~mask)
    torch.testing.assert_close(pre[mask], x[mask] / (1 - p))
    kept = mask.float().mean().item()
    assert abs(kept - (1 - p)) < 0.02, kept
    torch.manual_seed(123)
    _, pre2, mask2, _ = run()
    assert torch.equal(mask, mask2) and torch.equal(pre, pre2)
    torch.manual_seed(124)
    _, _, mask3, _ = run()
    assert not torch.equal(mask, mask3)


def test_dropout_draws_of_one_philox_call_are_independent():
    # Columns 4k .. 4k + 3 share a Philox counter (four draws per call): their keep decisions must
    # still be independent, and each column's keep rate 1 - p.
    torch.manual_seed(0)
    M, N, p = 512, 256, 0.5
    x = torch.randn(M, N, device=DEVICE) + 5.0
    w = torch.ones(N, device=DEVICE)
    _, mask, _ = layer_norm_fn(x, w, None, dropout_p=p, return_dropout_mask=True)
    keep = mask.float()
    for lane in range(4):
        assert abs(keep[:, lane::4].mean().item() - (1 - p)) < 0.02, lane
    for a, b in ((0, 1), (1, 2), (2, 3), (0, 3)):
        both = (keep[:, a::4] * keep[:, b::4]).mean().item()
        assert abs(both - (1 - p) ** 2) < 0.02, (a, b, both)


def check_backward_regenerates_the_forward_mask(M, N, p=0.5):
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, requires_grad=True)
    x1 = torch.randn(M, N, device=DEVICE, requires_grad=True)
    w = torch.randn(N, device=DEVICE)
    y, mask, mask1 = layer_norm_fn(x, w, None, x1=x1, dropout_p=p, return_dropout_mask=True)
    y.backward(torch.randn_like(y))
    assert torch.equal(x.grad == 0, ~mask)
    assert torch.equal(x1.grad == 0, ~mask1)
    assert not torch.equal(mask, mask1)  # independent draws for x and x1


def test_backward_regenerates_the_forward_mask():
    check_backward_regenerates_the_forward_mask(24, 128)


def test_out_and_residual_out_buffers_are_written():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 48, device=DEVICE)
    res = torch.randn(3, 5, 48, device=DEVICE)
    w, b = torch.randn(48, device=DEVICE), torch.randn(48, device=DEVICE)
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan"))
    y, pre = layer_norm_fn(x, w, b, residual=res, prenorm=True, out=out, residual_out=res_out)
    assert y.data_ptr() == out.data_ptr() and pre.data_ptr() == res_out.data_ptr()
    y_ref, pre_ref = layer_norm_ref(x, w, b, residual=res, prenorm=True)
    torch.testing.assert_close(out, y_ref)
    torch.testing.assert_close(res_out, pre_ref)


def test_bad_inputs_name_the_argument():
    x = torch.randn(4, 32, device=DEVICE)
    w = torch.randn(32, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm_fn(x, torch.randn(31, device=DEVICE), None)
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        layer_norm_fn(x, w, None, residual=torch.randn(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        layer_norm_fn(x, w, None, dropout_p=1.0)
    with pytest.raises(ValueError, match="rowscale is not supported together with x1"):
        layer_norm_fn(x, w, None, x1=x, rowscale=torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32"):
        layer_norm_fn(x.double(), w.double(), None)
    with pytest.raises(ValueError, match="hidden size"):
        big = torch.randn(1, 16385, device=DEVICE)
        layer_norm_fn(big, torch.ones(16385, device=DEVICE), None)
    with pytest.raises(ValueError, match="out must have the shape of x"):
        layer_norm_fn(x, w, None, out=torch.empty(4, 16, device=DEVICE))


@pytest.mark.parametrize("module_cls", [RMSNorm, LayerNorm])
@pytest.mark.parametrize("zero_centered_weight", [False, True])
def test_modules(module_cls, zero_centered_weight):
    torch.manual_seed(0)
    norm = module_cls(64, eps=1e-5, zero_centered_weight=zero_centered_weight, device=DEVICE)
    # Freshly initialised, the effective weight is 1 either way.
    expected_init = 0.0 if zero_centered_weight else 1.0
    assert torch.all(norm.weight == expected_init)
    assert (norm.bias is None) == (module_cls is RMSNorm)
    with torch.no_grad():
        norm.weight.normal_()
        if norm.bias is not None:
            norm.bias.normal_()
    x = torch.randn(2, 9, 64, device=DEVICE)
    res = torch.randn(2, 9, 64, device=DEVICE)
    y, pre = norm(x, residual=res, prenorm=True)
    ref_fn = rms_norm_ref if module_cls is RMSNorm else layer_norm_ref
    y_ref, pre_ref = ref_fn(x, norm.weight, norm.bias, residual=res, eps=1e-5, prenorm=True,
                            zero_centered_weight=zero_centered_weight)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pre, pre_ref)


def test_module_dropout_only_in_training():
    torch.manual_seed(0)
    norm = RMSNorm(32, dropout_p=0.5, device=DEVICE).eval()
    x = torch.randn(4, 32, device=DEVICE)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, None, eps=1e-5))
    norm.train()
    assert not torch.allclose(norm(x), rms_norm_ref(x, norm.weight, None, eps=1e-5))


@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("prenorm", [False, True])
def test_layer_norm_linear_fn(is_rms_norm, prenorm):
    torch.manual_seed(0)
    M, N, O = 13, 48, 24
    x = torch.randn(M, N, device=DEVICE)
    res = torch.randn(M, N, device=DEVICE)
    nw, nb = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    lw, lb = torch.randn(O, N, device=DEVICE) / N**0.5, torch.randn(O, device=DEVICE)
    leaves = [_leaf(t) for t in (x, res, nw, nb, lw, lb)]
    refs = [_leaf(t) for t in (x, res, nw, nb, lw, lb)]
    out = layer_norm_linear_fn(leaves[0], leaves[2], leaves[3], leaves[4], leaves[5],
                               residual=leaves[1], eps=1e-5, prenorm=prenorm,
                               is_rms_norm=is_rms_norm)
    ref_fn = rms_norm_ref if is_rms_norm else layer_norm_ref
    y_ref, pre_ref = ref_fn(refs[0], refs[2], refs[3], residual=refs[1], eps=1e-5, prenorm=True)
    out_ref = F.linear(y_ref, refs[4], refs[5])
    outs = out if prenorm else (out,)
    outs_ref = (out_ref, pre_ref) if prenorm else (out_ref,)
    for o, r in zip(outs, outs_ref):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(outs_ref, grads)
    for name, a, b in zip(["x", "residual", "norm_weight", "norm_bias", "linear_weight",
                           "linear_bias"], leaves, refs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4, msg=name)


# The multi-row tiles: bands of 5 rows walked 4 rows at a time, so that every band ends in a
# partial tile and M = 37 is a multiple of neither; the forward takes 4 rows per program.
MULTI_ROW_CASES = [
    dict(),
    dict(residual_dtype="same", prenorm=True, dropout_p=0.3),
    dict(has_x1=True, has_weight1=True, residual_dtype="same", dropout_p=0.2, prenorm=True),
    dict(has_x1=True, is_rms_norm=True, has_bias=False, zero_centered_weight=True),
    dict(is_rms_norm=True, has_bias=False, has_rowscale=True, dropout_p=0.1,
         residual_dtype=torch.float32, prenorm=True),
]


@pytest.fixture
def five_row_bands(monkeypatch):
    monkeypatch.setattr(ln, "_fwd_tile", lambda block_n: (4, 2))
    monkeypatch.setattr(ln, "_bwd_tile", lambda block_n: (4, 2))
    monkeypatch.setattr(ln, "_bwd_bands", lambda x, M, rows_per_iter, block_n:
                        (-(-M // 5), 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(MULTI_ROW_CASES)))
def test_multi_row_tiles(five_row_bands, case, dtype):
    run_case(37, 96, dtype, **_resolve(MULTI_ROW_CASES[case], dtype))


def test_multi_row_backward_regenerates_the_forward_mask(five_row_bands):
    check_backward_regenerates_the_forward_mask(37, 80)


def _is_power_of_2(n):
    return n >= 1 and n & (n - 1) == 0


@pytest.mark.parametrize("tile", [ln._fwd_tile, ln._bwd_tile])
def test_tile_helpers_return_valid_configs(tile):
    for block_n in (2**k for k in range(17)):
        rows, num_warps = tile(block_n)
        assert _is_power_of_2(rows) and rows <= 16, (block_n, rows)
        assert _is_power_of_2(num_warps) and num_warps <= 16, (block_n, num_warps)
        # Whole warps of elements, except where the tile is smaller than one warp.
        assert rows * block_n >= 32 * num_warps or num_warps == 1, (block_n, rows, num_warps)
        # One row at a time once a row alone fills the tile.
        assert rows == 1 or rows * block_n <= 4096, (block_n, rows)
    for block_n in (2**k for k in range(17)):
        assert isinstance(ln._bwd_num_stages(block_n), int) and ln._bwd_num_stages(block_n) >= 1
        assert 1 <= ln._bwd_programs_per_sm(block_n) <= 32, block_n


@pytest.mark.parametrize("is_cuda", [False, True])
def test_bwd_bands_cover_the_rows_in_whole_tiles(monkeypatch, is_cuda):
    monkeypatch.setattr(ln, "_sm_count", lambda device_index: 132)
    x = SimpleNamespace(is_cuda=is_cuda, device=SimpleNamespace(index=0))
    for M, block_n in itertools.product((1, 3, 37, 1000, 16384, 100003), (128, 1024, 8192)):
        rows_per_iter, _ = ln._bwd_tile(block_n)
        programs, rows_per_program = ln._bwd_bands(x, M, rows_per_iter, block_n)
        assert rows_per_program % rows_per_iter == 0
        assert (programs - 1) * rows_per_program < M <= programs * rows_per_program
        max_programs = 132 * ln._bwd_programs_per_sm(block_n) if is_cuda else 4
        assert programs <= max_programs, (M, block_n, programs)


# The two ways of finishing the weight / bias gradients (_atomic_param_grads): fp32 atomics and
# a ticket, or a row of partials per program summed in PyTorch. Every parameter gradient there
# is (weight, bias, weight1, bias1), mixed parameter dtypes, and more bands than programs of
# the CPU default (8 bands of 5 rows for M = 37), so that several programs add into the sums.
PARAM_GRAD_CASES = [
    dict(residual_dtype="same", prenorm=True),
    dict(is_rms_norm=True, has_bias=False),
    dict(has_x1=True, has_weight1=True, residual_dtype="same", dropout_p=0.2, prenorm=True),
    dict(has_weight1=True, weight_dtype=torch.float32, zero_centered_weight=True),
]
PARAM_NAMES = ("weight", "bias", "weight1", "bias1")


def _sum_order_error(a, p):
    """(max |a - p|, its bound) for two sums of the same fp32 terms in different orders: fp32
    rounding, then at most an ulp of p's dtype."""
    amax = p.float().abs().max().item()
    return (a.float() - p.float()).abs().max().item(), (2 * torch.finfo(p.dtype).eps + 1e-5) * amax + 1e-6


def _assert_param_grads_agree(atomic, partials):
    """The two ways sum the same fp32 rows in different orders: equal to fp32 rounding, then
    at most an ulp of the gradient's dtype apart (a sum on either side of a rounding boundary)."""
    assert [n for n in PARAM_NAMES if n in atomic] == [n for n in PARAM_NAMES if n in partials]
    for name in PARAM_NAMES:
        if name not in atomic:
            continue
        a, p = atomic[name], partials[name]
        assert a.dtype == p.dtype and a.shape == p.shape, name
        err, tol = _sum_order_error(a, p)
        assert err <= tol, f"grad {name}: atomic vs partials {err:.3g} > {tol:.3g}"


@pytest.fixture(params=["default", "five_row_bands"])
def bands(request, monkeypatch):
    if request.param == "five_row_bands":
        monkeypatch.setattr(ln, "_bwd_bands", lambda x, M, rows_per_iter, block_n:
                            (-(-M // 5), 5))
    return request.param


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for the test, the previous setting restored."""
    state = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(state[0], warn_only=state[1])


def test_param_grad_path_follows_deterministic_mode(deterministic):
    assert not ln._atomic_param_grads()
    torch.use_deterministic_algorithms(False)
    assert ln._atomic_param_grads()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(PARAM_GRAD_CASES)))
def test_atomic_and_partials_param_grads_agree(monkeypatch, bands, case, dtype):
    grads = {}
    for atomic in (True, False):
        monkeypatch.setattr(ln, "_atomic_param_grads", lambda atomic=atomic: atomic)
        # Each way against the references, then against each other.
        grads[atomic] = run_case(37, 96, dtype, **_resolve(PARAM_GRAD_CASES[case], dtype))[2]
    _assert_param_grads_agree(grads[True], grads[False])
    # Everything else comes out of the same kernel the same way.
    for name in set(grads[True]) - set(PARAM_NAMES):
        assert torch.equal(grads[True][name], grads[False][name]), name


def test_atomic_param_grads_with_mixed_dtypes(monkeypatch):
    """weight fp32, bias fp16: the gradients go to one buffer per dtype."""
    torch.manual_seed(0)
    M, N = 23, 80
    x, dy = torch.randn(M, N, device=DEVICE), torch.randn(M, N, device=DEVICE)
    w = torch.randn(N, device=DEVICE)
    b = torch.randn(N, device=DEVICE, dtype=torch.float16)
    _, _, mean, rstd, pre, *_ = ln._layer_norm_fwd(x, w, b, 1e-5)
    grads = {}
    for atomic in (True, False):
        monkeypatch.setattr(ln, "_atomic_param_grads", lambda atomic=atomic: atomic)
        _, dw, db, *_ = ln._layer_norm_bwd(dy, pre, w, b, 1e-5, mean, rstd)
        grads[atomic] = dict(weight=dw, bias=db)
    assert grads[True]["weight"].dtype == torch.float32
    assert grads[True]["bias"].dtype == torch.float16
    _assert_param_grads_agree(grads[True], grads[False])
    xhat = (x - x.mean(1, keepdim=True)) * rstd[:, None]
    torch.testing.assert_close(grads[False]["weight"], (dy * xhat).sum(0), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[False]["bias"], dy.sum(0).half(), atol=1e-2, rtol=1e-3)


def test_atomic_param_grads_without_rows(monkeypatch):
    """M = 0: no kernel runs, and the gradients are zeros either way."""
    monkeypatch.setattr(ln, "_atomic_param_grads", lambda: True)
    x = torch.empty(0, 64, device=DEVICE)
    w, b = torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE)
    _, _, mean, rstd, pre, *_ = ln._layer_norm_fwd(x, w, b, 1e-5)
    _, dw, db, *_ = ln._layer_norm_bwd(torch.empty_like(x), pre, w, b, 1e-5, mean, rstd)
    assert torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


def _backward_twice(M, N, dtype, case):
    """Every gradient of two backward runs of one forward (the same inputs and upstream grads)."""
    torch.manual_seed(0)
    case = _resolve(case, dtype)
    x = _leaf(torch.randn(M, N, device=DEVICE, dtype=dtype))
    w = _leaf(torch.randn(N, device=DEVICE, dtype=dtype))
    b = _leaf(torch.randn(N, device=DEVICE, dtype=dtype)) if case.get("has_bias", True) else None
    res = (_leaf(torch.randn(M, N, device=DEVICE, dtype=dtype))
           if case.get("residual_dtype") is not None else None)
    x1 = _leaf(torch.randn(M, N, device=DEVICE, dtype=dtype)) if case.get("has_x1") else None
    w1 = _leaf(torch.randn(N, device=DEVICE, dtype=dtype)) if case.get("has_weight1") else None
    b1 = (_leaf(torch.randn(N, device=DEVICE, dtype=dtype))
          if w1 is not None and b is not None else None)
    leaves = [t for t in (x, w, b, res, x1, w1, b1) if t is not None]
    outs = layer_norm_fn(x, w, b, residual=res, x1=x1, weight1=w1, bias1=b1, eps=1e-5,
                         dropout_p=case.get("dropout_p", 0.0), prenorm=case.get("prenorm", False),
                         zero_centered_weight=case.get("zero_centered_weight", False),
                         is_rms_norm=case.get("is_rms_norm", False))
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    dys = [torch.randn_like(o) for o in outs]
    return [torch.autograd.grad(outs, leaves, dys, retain_graph=True) for _ in range(2)]


@pytest.mark.parametrize("case", range(len(PARAM_GRAD_CASES)))
def test_deterministic_backward_is_bitwise_repeatable(deterministic, bands, case):
    first, second = _backward_twice(37, 96, torch.float32, PARAM_GRAD_CASES[case])
    for k, (g1, g2) in enumerate(zip(first, second)):
        assert torch.equal(g1, g2), f"gradient {k} differs between two deterministic runs"


def _nan_filled_empty(empty):
    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return nan_empty


@pytest.mark.parametrize("case", range(len(PARAM_GRAD_CASES)))
def test_atomic_backward_adds_into_the_sums_its_forward_zeroed(monkeypatch, case):
    """The forward kernel zeroes the atomic backward's sums (and ticket), so the backward runs no
    memset: with every float buffer allocated NaN-filled and torch.zeros out of reach, both
    backward runs of one forward (the kernel zeroes the sums again for the second) give the
    deterministic path's gradients up to the order of the sums."""
    monkeypatch.setattr(ln, "_atomic_param_grads", lambda: False)
    reference = _backward_twice(37, 96, torch.float32, PARAM_GRAD_CASES[case])[0]
    monkeypatch.setattr(ln, "_atomic_param_grads", lambda: True)
    monkeypatch.setattr(torch, "empty", _nan_filled_empty(torch.empty))

    def no_zeros(*args, **kwargs):
        raise AssertionError("the forward-zeroed sums should leave the backward no memset")

    monkeypatch.setattr(ln.torch, "zeros", no_zeros)
    for run in _backward_twice(37, 96, torch.float32, PARAM_GRAD_CASES[case]):
        for k, (a, p) in enumerate(zip(run, reference)):
            err, tol = _sum_order_error(a, p)
            assert err <= tol, (k, err)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N", [(16384, 1024), (4099, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", range(len(PARAM_GRAD_CASES)))
def test_atomic_param_grads_gpu(monkeypatch, M, N, dtype, case):
    """Hundreds of programs adding into the sums at once: each way against the references, the
    two against each other, and repeated atomic runs (an ordering bug in the ticket would show
    as a stale sum now and then) against the deterministic one."""
    grads = {}
    for atomic in (True, False):
        monkeypatch.setattr(ln, "_atomic_param_grads", lambda atomic=atomic: atomic)
        grads[atomic] = run_case(M, N, dtype, **_resolve(PARAM_GRAD_CASES[case], dtype))[2]
    _assert_param_grads_agree(grads[True], grads[False])
    monkeypatch.setattr(ln, "_atomic_param_grads", lambda: False)
    reference = _backward_twice(M, N, dtype, PARAM_GRAD_CASES[case])
    assert all(torch.equal(a, b) for a, b in zip(*reference))
    monkeypatch.setattr(ln, "_atomic_param_grads", lambda: True)
    for _ in range(5):
        for run in _backward_twice(M, N, dtype, PARAM_GRAD_CASES[case]):
            for k, (a, p) in enumerate(zip(run, reference[0])):
                err, tol = _sum_order_error(a, p)
                assert err <= tol, (k, err)


def test_pipeline_stages_fit_the_shared_memory_budget():
    """The staged tiles of a pipelined loop stay within the budget (Triton keeps them in shared
    memory: fp32 rows of 4K with four row inputs asked for 256 KB at 5 stages on the H200)."""
    for stages, tile_bytes in itertools.product(range(1, 7), (4096, 65536, 98304, 200000)):
        got = ln._pipeline_stages(stages, tile_bytes)
        assert 1 <= got <= stages
        assert got == 1 or (got - 1) * tile_bytes <= ln._PIPELINE_SMEM_BYTES, (stages, tile_bytes)
        assert got == stages or got * tile_bytes > ln._PIPELINE_SMEM_BYTES  # capped only when needed
    for block_n in (2**k for k in range(17)):
        assert ln._fwd_programs_per_sm(block_n) is None or 1 <= ln._fwd_programs_per_sm(block_n) <= 32
        assert isinstance(ln._fwd_num_stages(block_n), int) and ln._fwd_num_stages(block_n) >= 1
