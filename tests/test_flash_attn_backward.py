"""Attention backward: gradients of the kernels against the fp32 reference of
flash_attn.utils.testing, with the forward's error rule (|ours - fp32 ref| <= 2 * |ref in dtype -
fp32 ref| + slack, max-abs per gradient), determinism, packed layouts, varlen, torch.compile.
"""

import pytest
import torch

from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_qkvpacked_func,
)
from flash_attn.utils.testing import (
    attention_ref,
    check_error_rule,
    dropout_mask_from_S_dmask,
    generate_qkv,
    generate_random_padding_mask,
    heads_for,
    random_window,
)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
SLACK = 1e-5


def _check(name, ours, ref, pt):
    check_error_rule(name, ours, ref, pt, SLACK)


def _check_grads(grads, grads_ref, grads_pt, dtype):
    """The error rule for dq, dk, dv. The absolute slack is relative to the gradients' size: they
    grow with the sequence (a dV row sums seqlen_q terms) and a mathematically zero gradient is a
    difference of such fp32 sums (dP - rowsum(dO * O)), e.g. dK when seqlen_k = 1, which the
    dtype reference happens to produce as exact zeros."""
    scale = max(1.0, max(g.abs().max().item() for g in grads_ref))
    for name, ours, ref, pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert ours.shape == ref.shape and ours.dtype == dtype
        check_error_rule(name, ours, ref, pt, SLACK * scale)


def _grads_ref(q, k, v, g, **kwargs):
    out_ref, _ = attention_ref(q, k, v, **kwargs)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kwargs)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), g)
    grads_pt = torch.autograd.grad(out_pt, (q, k, v), g)
    return out_ref, out_pt, grads_ref, grads_pt


def _run_and_check(batch, seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi, softcap,
                   dropout_p, deterministic=False):
    nheads, nheads_k = heads_for(mha_type)
    q = torch.randn(batch, seqlen_q, nheads, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype, requires_grad=True)
    window_size = random_window(causal, local, seqlen_k)
    alibi_slopes = (torch.rand(batch, nheads, device=DEVICE) * 0.3) if alibi else None
    out, _, S_dmask = flash_attn_func(q, k, v, dropout_p, causal=causal, window_size=window_size,
                                      softcap=softcap, alibi_slopes=alibi_slopes,
                                      deterministic=deterministic, return_attn_probs=True)
    dropout_mask = dropout_mask_from_S_dmask(S_dmask, seqlen_q, seqlen_k) if dropout_p > 0 else None
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    out_ref, out_pt, grads_ref, grads_pt = _grads_ref(
        q, k, v, g, dropout_p=dropout_p, dropout_mask=dropout_mask, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    _check("out", out, out_ref, out_pt)
    _check_grads((dq, dk, dv), grads_ref, grads_pt, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mha_type", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (256, 97), (1025, 1024)])
def test_backward_features(seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi, softcap,
                           dropout_p):
    torch.manual_seed(seqlen_q + 7 * seqlen_k + d)
    _run_and_check(2, seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi, softcap,
                   dropout_p)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (97, 97), (128, 128), (200, 200), (1025, 1025),
                                               (1, 239), (3, 799), (239, 1), (799, 3), (113, 1024)])
def test_backward_shapes(seqlen_q, seqlen_k, d, causal, dtype):
    torch.manual_seed(seqlen_q + 3 * seqlen_k + d)
    _run_and_check(2, seqlen_q, seqlen_k, d, dtype, "mha", causal, False, False, 0.0, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 59, 96, 111, 160, 192, 224, 256])
@pytest.mark.parametrize("mha_type", ["mha", "gqa"])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 147), (97, 97), (384, 256), (1024, 1025)])
def test_backward_features_all_head_dims(seqlen_q, seqlen_k, d, dtype, mha_type, causal, local,
                                         alibi, softcap, dropout_p):
    torch.manual_seed(seqlen_q + seqlen_k + d)
    _run_and_check(2, seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi, softcap,
                   dropout_p)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [59, 64, 128])
@pytest.mark.parametrize("mha_type", ["mha", "gqa"])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("mode", ["random", "zero_lengths"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(97, 203), (512, 256), (1024, 1024)])
def test_backward_varlen(seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, dropout_p, mode):
    torch.manual_seed(seqlen_q + seqlen_k + d)
    batch = 5
    nheads, nheads_k = heads_for(mha_type)
    q = torch.randn(batch, seqlen_q, nheads, d, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype)
    zero = mode == "zero_lengths"
    query_padding_mask = generate_random_padding_mask(seqlen_q, batch, DEVICE, "random", zero)
    key_padding_mask = generate_random_padding_mask(seqlen_k, batch, DEVICE, "random", zero)
    (q_unpad, k_unpad, v_unpad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, v,
     output_pad_fn, dq_pad_fn, dk_pad_fn) = generate_qkv(q, k, v, query_padding_mask, key_padding_mask)
    window_size = random_window(causal, local, seqlen_k)
    out_unpad, _, S_dmask = flash_attn_varlen_func(
        q_unpad, k_unpad, v_unpad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, causal=causal, window_size=window_size, return_attn_probs=True)
    dropout_mask = None
    if dropout_p > 0:
        dropout_mask = torch.ones(batch, nheads, seqlen_q, seqlen_k, dtype=torch.bool, device=DEVICE)
        dropout_mask[:, :, :max_seqlen_q, :max_seqlen_k] = dropout_mask_from_S_dmask(
            S_dmask, max_seqlen_q, max_seqlen_k)
    out = output_pad_fn(out_unpad)
    g = torch.randn_like(out)
    dq_unpad, dk_unpad, dv_unpad = torch.autograd.grad(out, (q_unpad, k_unpad, v_unpad), g)
    _, _, grads_ref, grads_pt = _grads_ref(
        q, k, v, g, query_padding_mask=query_padding_mask, key_padding_mask=key_padding_mask,
        dropout_p=dropout_p, dropout_mask=dropout_mask, causal=causal, window_size=window_size)
    ours = (dq_pad_fn(dq_unpad), dk_pad_fn(dk_unpad), dk_pad_fn(dv_unpad))
    _check_grads(ours, grads_ref, grads_pt, dtype)


@pytest.mark.parametrize("mha_type", ["mha", "gqa"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("varlen", [False, True])
def test_deterministic_backward_is_bitwise_reproducible(mha_type, dropout_p, varlen):
    torch.manual_seed(0)
    batch, seqlen, d = 3, 1537, 128
    nheads, nheads_k = heads_for(mha_type)
    q = torch.randn(batch * seqlen, nheads, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch * seqlen, nheads_k, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    cu_seqlens = torch.arange(0, (batch + 1) * seqlen, seqlen, device=DEVICE, dtype=torch.int32)
    g = torch.randn_like(q)

    def grads():
        torch.manual_seed(42)  # the same dropout mask in every run
        if varlen:
            out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, seqlen, seqlen, dropout_p,
                                         causal=True, deterministic=True)
        else:
            out = flash_attn_func(*(t.view(batch, seqlen, *t.shape[1:]) for t in (q, k, v)), dropout_p,
                                  causal=True, deterministic=True).view_as(q)
        return torch.autograd.grad(out, (q, k, v), g)

    first = grads()
    for _ in range(3):
        again = grads()
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 59])
def test_packed_gradients_match_unpacked(dtype, d):
    """qkvpacked / kvpacked / varlen-qkvpacked give the unpacked gradients, in their own layout."""
    torch.manual_seed(0)
    batch, seqlen, nheads = 2, 333, 4
    qkv = torch.randn(batch, seqlen, 3, nheads, d, device=DEVICE, dtype=dtype, requires_grad=True)
    g = torch.randn(batch, seqlen, nheads, d, device=DEVICE, dtype=dtype)
    (dqkv,) = torch.autograd.grad(flash_attn_qkvpacked_func(qkv, causal=True), (qkv,), g)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    dq, dk, dv = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), g)
    assert dqkv.shape == qkv.shape
    torch.testing.assert_close(dqkv, torch.stack([dq, dk, dv], dim=2), atol=0, rtol=0)
    kv = qkv.detach()[:, :, 1:].clone().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    dq2, dkv = torch.autograd.grad(flash_attn_kvpacked_func(q2, kv, causal=True), (q2, kv), g)
    torch.testing.assert_close(dq2, dq, atol=0, rtol=0)
    torch.testing.assert_close(dkv, torch.stack([dk, dv], dim=2), atol=0, rtol=0)
    flat = qkv.detach().reshape(batch * seqlen, 3, nheads, d).requires_grad_()
    cu_seqlens = torch.arange(0, (batch + 1) * seqlen, seqlen, device=DEVICE, dtype=torch.int32)
    (dflat,) = torch.autograd.grad(
        flash_attn_varlen_qkvpacked_func(flat, cu_seqlens, seqlen, causal=True),
        (flat,), g.reshape(batch * seqlen, nheads, d))
    torch.testing.assert_close(dflat, dqkv.reshape_as(dflat), atol=0, rtol=0)


def test_training_step_under_torch_compile():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 256, 4, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True).float().square().sum()

    compiled = torch.compile(step, fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    expected = torch.autograd.grad(step(q, k, v), (q, k, v))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)


def test_memory_linear_in_seqlen():
    """Forward + backward keep nothing of size seqlen^2: extra memory per token is constant."""
    per_token = []
    for seqlen in (2048, 8192):
        q, k, v = (torch.randn(1, seqlen, 8, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        flash_attn_func(q, k, v, causal=True).sum().backward()
        torch.cuda.synchronize()
        per_token.append((torch.cuda.max_memory_allocated() - base) / seqlen)
    assert per_token[1] <= 1.1 * per_token[0], per_token


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_into_unaligned_views_match_fresh_ones(d, causal):
    """dk and dv passed in as views whose rows are 4-byte but not 16-byte aligned, so that the
    warp-specialised backward (from 1K keys) writes them from registers instead of through its
    staged epilogue's bulk copies: the same bits as into tensors it allocates, every row written
    (the last key block a partial one)."""
    torch.manual_seed(d + causal)
    batch, seqlen, heads = 2, 1100, 4
    q, k, v = (torch.randn(batch, seqlen, heads, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    g = torch.randn_like(q)
    scale = d ** -0.5
    out, lse, _, rng_state = torch.ops.flash_attn._flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0,
                                                                       None, False)

    def backward(dk, dv):
        dq = torch.empty_like(q)
        torch.ops.flash_attn._flash_attn_backward(g, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, -1,
                                                  -1, 0.0, None, False, rng_state)
        return dq, dk, dv

    fresh = backward(torch.empty_like(k), torch.empty_like(v))
    # Views 2 elements (4 bytes) into a NaN-filled buffer: rows at 16-byte offsets + 4.
    buffers = [torch.full((k.numel() + 8,), float("nan"), device=DEVICE, dtype=k.dtype) for _ in range(2)]
    views = [buf[2:2 + k.numel()].view_as(k) for buf in buffers]
    assert all(view.data_ptr() % 16 == 4 for view in views)
    unaligned = backward(*views)
    for name, a, b in zip(("dq", "dk", "dv"), fresh, unaligned):
        assert not b.isnan().any(), name
        if name != "dq":  # dq's tiles are added in whatever order the key blocks finish
            torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)
