"""Attention forward: the kernels against the fp32 reference of flash_attn.utils.testing.

Error rule (flash-attn's): |ours - fp32 reference| <= 2 * |reference in the input dtype - fp32
reference| + a small absolute slack, both as max-abs over the output. Outputs are NaN-poisoned
before the kernel writes them (via `out=`) where the entry point allows it.
"""

import math

import pytest
import torch

from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flash_attn.flash_attn_interface import _get_block_size_n
from flash_attn.utils.testing import (
    attention_ref,
    check_error_rule,
    attn_bias_from_alibi_slopes,
    construct_local_mask,
    dropout_mask_from_S_dmask,
    generate_qkv,
    generate_random_padding_mask,
    heads_for,
    random_window,
)

SLACK = 1e-5
gpu = pytest.mark.gpu
DEVICE = "cuda"


def _check(out, out_ref, out_pt, what="out"):
    check_error_rule(what, out, out_ref, out_pt, SLACK)


def _lse_ref(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """fp32 log-sum-exp of the masked scores, (b, h, s_q); rows with no key give +inf."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + attn_bias_from_alibi_slopes(alibi_slopes, seqlen_q, seqlen_k)
    window = (window_size[0], 0) if causal else window_size
    masked = construct_local_mask(seqlen_q, seqlen_k, window, device=q.device)
    scores = scores.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def _run_and_check(batch, seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi, softcap,
                   dropout_p, check_lse=True):
    nheads, nheads_k = heads_for(mha_type)
    q = torch.randn(batch, seqlen_q, nheads, d, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype)
    window_size = random_window(causal, local, seqlen_k)
    alibi_slopes = (torch.rand(batch, nheads, device=DEVICE, dtype=torch.float32) * 0.3
                    if alibi else None)
    out, lse, S_dmask = flash_attn_func(q, k, v, dropout_p, causal=causal, window_size=window_size,
                                        softcap=softcap, alibi_slopes=alibi_slopes,
                                        return_attn_probs=True)
    dropout_mask = None
    if dropout_p > 0:
        assert S_dmask.shape == (batch, nheads, -(-seqlen_q // 128) * 128, -(-seqlen_k // 128) * 128)
        dropout_mask = dropout_mask_from_S_dmask(S_dmask, seqlen_q, seqlen_k)
    else:
        assert S_dmask.numel() == 0
    kwargs = dict(dropout_p=dropout_p, dropout_mask=dropout_mask, causal=causal,
                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    out_ref, attn_ref = attention_ref(q, k, v, **kwargs)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kwargs)
    _check(out, out_ref, out_pt)
    if dropout_p > 0 and seqlen_q * seqlen_k >= 128 * 128:
        valid = attn_ref > 0
        kept = (dropout_mask & valid).sum().item() / max(valid.sum().item(), 1)
        assert abs((1 - kept) - dropout_p) < 0.025, f"dropped fraction {1 - kept} vs p {dropout_p}"
    if check_lse:
        lse_ref = _lse_ref(q, k, d ** -0.5, causal, window_size, softcap, alibi_slopes)
        assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite), "lse must be +inf exactly on empty rows"
        torch.testing.assert_close(lse[finite], lse_ref[finite], atol=2e-3, rtol=1e-3)


# Every feature alone and combined, on shapes that are not tile multiples.
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mha_type", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (256, 97), (1025, 1024)])
def test_features(seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi, softcap, dropout_p):
    torch.manual_seed(seqlen_q * 7 + seqlen_k + d)
    _run_and_check(2, seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi, softcap,
                   dropout_p)


# Every head dim and sequence length of the issue, plain and causal.
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (97, 97), (128, 128), (200, 200),
                                               (384, 384), (1024, 1024), (1025, 1025),
                                               (2048, 2048), (1, 239), (3, 799), (127, 512),
                                               (239, 1), (799, 3), (1024, 128), (113, 2048)])
def test_shapes(seqlen_q, seqlen_k, d, causal, dtype):
    torch.manual_seed(seqlen_q + 3 * seqlen_k + d)
    batch = 4 if seqlen_q * seqlen_k <= 1024 * 1024 else 2
    _run_and_check(batch, seqlen_q, seqlen_k, d, dtype, "mha", causal, False, False, 0.0, 0.0)


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 59, 96, 111, 160, 192, 224, 256])
@pytest.mark.parametrize("mha_type", ["mha", "gqa"])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 147), (97, 97), (384, 256), (1024, 1025)])
def test_features_all_head_dims(seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi,
                                softcap, dropout_p):
    torch.manual_seed(seqlen_q + seqlen_k + d)
    _run_and_check(2, seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi, softcap,
                   dropout_p)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [59, 64, 128])
@pytest.mark.parametrize("mha_type", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("alibi,softcap", [(False, 0.0), (True, 0.0), (False, 30.0)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("mode", ["random", "third", "zero_lengths"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(97, 203), (512, 256), (1024, 1024)])
def test_varlen(seqlen_q, seqlen_k, d, dtype, mha_type, causal, local, alibi, softcap, dropout_p,
                mode):
    torch.manual_seed(seqlen_q + seqlen_k + d)
    batch = 5
    nheads, nheads_k = heads_for(mha_type)
    q = torch.randn(batch, seqlen_q, nheads, d, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype)
    zero = mode == "zero_lengths"
    query_padding_mask = generate_random_padding_mask(seqlen_q, batch, DEVICE,
                                                      mode="random" if zero else mode,
                                                      zero_lengths=zero)
    key_padding_mask = generate_random_padding_mask(seqlen_k, batch, DEVICE,
                                                    mode="random" if zero else mode,
                                                    zero_lengths=zero)
    (q_unpad, k_unpad, v_unpad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_,
     output_pad_fn, _, _) = generate_qkv(q, k, v, query_padding_mask, key_padding_mask)
    window_size = random_window(causal, local, seqlen_k)
    alibi_slopes = torch.rand(nheads, device=DEVICE) * 0.3 if alibi else None
    out_unpad, lse, S_dmask = flash_attn_varlen_func(
        q_unpad, k_unpad, v_unpad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, return_attn_probs=True)
    assert lse.shape == (nheads, q_unpad.shape[0])
    out = output_pad_fn(out_unpad)
    dropout_mask = None
    if dropout_p > 0:
        # S_dmask spans the longest sequences; padded positions beyond them are masked anyway.
        dropout_mask = torch.ones(batch, nheads, seqlen_q, seqlen_k, dtype=torch.bool, device=DEVICE)
        dropout_mask[:, :, :max_seqlen_q, :max_seqlen_k] = dropout_mask_from_S_dmask(
            S_dmask, max_seqlen_q, max_seqlen_k)
    kwargs = dict(query_padding_mask=query_padding_mask, key_padding_mask=key_padding_mask,
                  dropout_p=dropout_p, dropout_mask=dropout_mask, causal=causal,
                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    out_ref, _ = attention_ref(q, k, v, **kwargs)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kwargs)
    _check(out, out_ref, out_pt)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mha_type", ["mha", "gqa"])
@pytest.mark.parametrize("page_block_size", [16, 48, 256, 512])
def test_varlen_paged(d, dtype, causal, mha_type, page_block_size):
    """K/V in a paged cache: block_table maps each sequence's logical blocks to shuffled pages."""
    torch.manual_seed(d + page_block_size)
    batch, seqlen_q, seqlen_k = 3, 300, 1100
    nheads, nheads_k = heads_for(mha_type)
    q = torch.randn(batch, seqlen_q, nheads, d, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, d, device=DEVICE, dtype=dtype)
    query_padding_mask = generate_random_padding_mask(seqlen_q, batch, DEVICE, mode="random")
    key_padding_mask = generate_random_padding_mask(seqlen_k, batch, DEVICE, mode="random")
    q_unpad, _, _, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_, output_pad_fn, _, _ = (
        generate_qkv(q, k, v, query_padding_mask, key_padding_mask))
    blocks_per_seq = -(-seqlen_k // page_block_size)
    num_blocks = batch * blocks_per_seq + 3
    block_table = torch.randperm(num_blocks, device=DEVICE)[: batch * blocks_per_seq]
    block_table = block_table.view(batch, blocks_per_seq).to(torch.int32)
    k_cache = torch.full((num_blocks, page_block_size, nheads_k, d), float("nan"), device=DEVICE,
                         dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    padded = blocks_per_seq * page_block_size
    k_pad = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, padded - seqlen_k))
    v_pad = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, padded - seqlen_k))
    k_cache[block_table.long()] = k_pad.view(batch, blocks_per_seq, page_block_size, nheads_k, d)
    v_cache[block_table.long()] = v_pad.view(batch, blocks_per_seq, page_block_size, nheads_k, d)
    out_unpad = flash_attn_varlen_func(q_unpad, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, causal=causal,
                                       block_table=block_table)
    out = output_pad_fn(out_unpad)
    kwargs = dict(query_padding_mask=query_padding_mask, key_padding_mask=key_padding_mask,
                  causal=causal)
    out_ref, _ = attention_ref(q, k, v, **kwargs)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kwargs)
    _check(out, out_ref, out_pt)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_forms_match_plain(dtype, causal):
    """qkvpacked / kvpacked (strided views, no copies) and their varlen forms give the plain result."""
    torch.manual_seed(0)
    batch, seqlen, nheads, d = 3, 333, 4, 96
    qkv = torch.randn(batch, seqlen, 3, nheads, d, device=DEVICE, dtype=dtype)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=causal)
    torch.testing.assert_close(flash_attn_qkvpacked_func(qkv, causal=causal), out, atol=0, rtol=0)
    torch.testing.assert_close(flash_attn_kvpacked_func(q, qkv[:, :, 1:], causal=causal), out,
                               atol=0, rtol=0)
    cu_seqlens = torch.arange(0, (batch + 1) * seqlen, seqlen, device=DEVICE, dtype=torch.int32)
    flat = qkv.reshape(batch * seqlen, 3, nheads, d)
    out_flat = out.reshape(batch * seqlen, nheads, d)
    torch.testing.assert_close(
        flash_attn_varlen_qkvpacked_func(flat, cu_seqlens, seqlen, causal=causal), out_flat,
        atol=0, rtol=0)
    torch.testing.assert_close(
        flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu_seqlens, cu_seqlens, seqlen,
                                        seqlen, causal=causal), out_flat, atol=0, rtol=0)


@gpu
def test_strided_inputs_and_out_poisoning():
    """Inputs that are views with a contiguous last dim run without copies; every output element
    is written (the binding's out= buffer starts as NaN)."""
    import flash_attn_2_cuda

    torch.manual_seed(0)
    big = torch.randn(2, 300, 8, 160, device=DEVICE, dtype=torch.bfloat16)
    q, k, v = big[:, :, :4, :128], big[:, :, 4:6, :128], big[:, :, 6:, 32:]
    assert not q.is_contiguous()
    out = torch.full((2, 300, 4, 128), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    flash_attn_2_cuda.fwd(q, k, v, out, None, 0.0, 128 ** -0.5, True, -1, -1, 0.0, False, None)
    out_ref, _ = attention_ref(q, k, v, causal=True)
    out_pt, _ = attention_ref(q, k, v, causal=True, upcast=False, reorder_ops=True)
    _check(out, out_ref, out_pt)


@gpu
def test_fully_masked_rows_give_zero_and_inf_lse():
    torch.manual_seed(0)
    q = torch.randn(2, 300, 4, 64, device=DEVICE, dtype=torch.float16)
    k = torch.randn(2, 100, 4, 64, device=DEVICE, dtype=torch.float16)
    out, lse, _ = flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    # Bottom-right alignment: the first 200 queries precede every key.
    assert torch.all(out[:, :200] == 0) and not out.isnan().any()
    assert torch.all(torch.isinf(lse[:, :, :200])) and torch.isfinite(lse[:, :, 200:]).all()
    # A window that excludes every key for the first queries: keys [i - 10 - 2, i - 10 + 1].
    k2 = torch.randn(2, 40, 4, 64, device=DEVICE, dtype=torch.float16)
    out2, lse2, _ = flash_attn_func(q[:, :50], k2, k2, window_size=(2, 1), return_attn_probs=True)
    assert not out2.isnan().any() and torch.all(out2[:, :9] == 0)
    assert torch.all(torch.isinf(lse2[:, :, :9])) and torch.isfinite(lse2[:, :, 9:]).all()


@gpu
def test_dropout_reproducible_with_manual_seed_and_mask_consistent():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 513, 4, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    torch.manual_seed(123)
    out1, _, s1 = flash_attn_func(q, k, v, 0.3, return_attn_probs=True)
    torch.manual_seed(123)
    out2, _, s2 = flash_attn_func(q, k, v, 0.3, return_attn_probs=True)
    out3 = flash_attn_func(q, k, v, 0.3)
    assert torch.equal(out1, out2) and torch.equal(s1, s2)
    assert not torch.equal(out1, out3), "the generator must advance between calls"
    # The mask rebuilt from S_dmask reproduces the kernel's output.
    mask = dropout_mask_from_S_dmask(s1, 513, 513)
    out_ref, _ = attention_ref(q, k, v, dropout_p=0.3, dropout_mask=mask)
    out_pt, _ = attention_ref(q, k, v, dropout_p=0.3, dropout_mask=mask, upcast=False,
                              reorder_ops=True)
    _check(out1, out_ref, out_pt)


@gpu
def test_dropout_under_cuda_graph_replays_new_masks():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    flash_attn_func(q, k, v, 0.5)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, 0.5)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out), "each replay must draw a new dropout mask"


@gpu
def test_64bit_offsets():
    """More than 2^31 elements per tensor: the last batch entries still come out right."""
    batch, seqlen, nheads, d = 8200, 128, 16, 128
    assert batch * seqlen * nheads * d > 2 ** 31
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen, nheads, d, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True)
    tail = slice(batch - 3, batch)
    out_ref, _ = attention_ref(q[tail], k[tail], v[tail], causal=True)
    out_pt, _ = attention_ref(q[tail], k[tail], v[tail], causal=True, upcast=False,
                              reorder_ops=True)
    _check(out[tail], out_ref, out_pt)
    del q, k, v, out
    torch.cuda.empty_cache()


@gpu
def test_torch_compile_fullgraph():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 128, 4, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        return flash_attn_func(q, k, v, causal=True) * 2

    torch.testing.assert_close(attend(q, k, v), flash_attn_func(q, k, v, causal=True) * 2)


@gpu
def test_block_size_n_follows_the_kernel_that_runs_the_head_dim():
    from flash_attn._native import extension_available
    from flash_attn.flash_attn_interface import _FORWARD_KEY_BLOCK, _cuda_ext

    for head_dim in (32, 40, 64, 96, 111, 128, 160, 192, 224, 256):
        for dropout in (False, True):
            if extension_available("flash_attn_2_cuda"):
                kernel = _cuda_ext().kernel_head_dim((head_dim + 7) // 8 * 8)
            else:  # every kernel of the table
                kernel = min(d for d in _FORWARD_KEY_BLOCK if d >= head_dim)
            assert _get_block_size_n(DEVICE, head_dim, dropout, True) == \
                _FORWARD_KEY_BLOCK[kernel][int(dropout)], (head_dim, dropout)
    assert _FORWARD_KEY_BLOCK[128] == (64, 32) and _FORWARD_KEY_BLOCK[64] == (128, 64)


def test_block_size_n_mirrors_tile_sizes_h():
    """_FORWARD_KEY_BLOCK is the Python mirror of the forward tile table in tile_sizes.h."""
    import re
    from pathlib import Path

    from flash_attn.flash_attn_interface import _FORWARD_KEY_BLOCK

    header = (Path(__file__).resolve().parents[1] / "csrc/flash_attn/src/tile_sizes.h").read_text()
    rows = re.findall(r"^FLASH_FWD_TILE\((\d+), (\d+), (\d+), (\d+), (\d+)\)", header, re.M)
    assert len(rows) == 8
    assert {int(d): (int(n), int(n_dropout)) for d, _, n, _, n_dropout in rows} == _FORWARD_KEY_BLOCK


# --- bad input: checked in Python before any CUDA work, so these run on CPU too ---------------

def _qkv(dtype=torch.float16, shape_q=(1, 8, 2, 16), shape_k=(1, 8, 2, 16)):
    return torch.randn(shape_q).to(dtype), torch.randn(shape_k).to(dtype), torch.randn(shape_k).to(dtype)


def _varlen_qkv(total_q=8, total_k=8):
    return (torch.randn(total_q, 2, 16).half(), torch.randn(total_k, 2, 16).half(),
            torch.randn(total_k, 2, 16).half())


def _paged_kv(num_blocks=2, page_block_size=256):
    k = torch.randn(num_blocks, page_block_size, 2, 16).half()
    return k, torch.randn_like(k)


def _cu(offsets):
    return torch.tensor(offsets, dtype=torch.int32)


@pytest.mark.parametrize("call,match", [
    (lambda: flash_attn_func(*_qkv(torch.float32)), "q must be float16 or bfloat16"),
    (lambda: flash_attn_func(*_qkv(shape_k=(1, 8, 2, 24))), "k and v must be of the same head dim"),
    (lambda: flash_attn_func(*_qkv(shape_q=(1, 8, 3, 16))), "k must be a number of heads dividing"),
    (lambda: flash_attn_func(*_qkv(shape_q=(1, 8, 2, 264), shape_k=(1, 8, 2, 264))),
     "head dim at most 256"),
    (lambda: flash_attn_func(*_qkv(shape_q=(8, 2, 16))), "q must be 4-D"),
    (lambda: flash_attn_func(*_qkv(shape_k=(2, 8, 2, 16))), "k must be of batch size 1"),
    (lambda: flash_attn_func(torch.randn(1, 8, 2, 32).half()[..., ::2], *_qkv()[1:]),
     "q must be contiguous in its last dimension"),
    (lambda: flash_attn_func(*_qkv(), dropout_p=1.0), "dropout_p must be in"),
    (lambda: flash_attn_func(*_qkv(), softcap=-1.0), "softcap must be >= 0"),
    (lambda: flash_attn_func(*_qkv(), alibi_slopes=torch.ones(2, dtype=torch.float16)),
     "alibi_slopes must be float32"),
    (lambda: flash_attn_func(*_qkv(), alibi_slopes=torch.ones(3)), "alibi_slopes must be of shape"),
    (lambda: flash_attn_func(*_qkv()), "q must be on a CUDA device"),
    (lambda: flash_attn_varlen_func(torch.randn(8, 2, 16).half(), torch.randn(8, 2, 16).half(),
                                    torch.randn(8, 2, 16).half(), torch.tensor([0, 8]),
                                    torch.tensor([0, 8], dtype=torch.int32), 8, 8),
     "cu_seqlens_q must be a 1-D torch.int32"),
    (lambda: flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 2, 16).half()), "qkv must be a"),
    (lambda: flash_attn_func(*_qkv(), window_size=(-2, 0)), "window_size must be a pair"),
    (lambda: flash_attn_func(*_qkv(), window_size=(4,)), "window_size must be a pair"),
    (lambda: flash_attn_func(*_qkv(), window_size=(1.5, 0)), "window_size must be a pair"),
    (lambda: flash_attn_func(*_qkv(), softcap=float("nan")), "softcap must be >= 0"),
    (lambda: flash_attn_varlen_func(*_varlen_qkv(), _cu([0, 8]), _cu([0, 8]), -1, 8),
     "max_seqlen_q must be an int >= 0"),
    (lambda: flash_attn_varlen_func(*_varlen_qkv(), _cu([0, 8]), _cu([0, 8]), 8, 8.5),
     "max_seqlen_k must be an int >= 0"),
    (lambda: flash_attn_varlen_func(torch.randn(8, 2, 16).half(), *_paged_kv(), _cu([0, 8]),
                                    _cu([0, 8]), 8, 8,
                                    block_table=torch.zeros(2, 1, dtype=torch.int32)),
     "block_table must be of 1 rows"),
])
def test_bad_input_names_the_argument(call, match):
    if torch.cuda.is_available() and "CUDA device" in match:
        pytest.skip("CPU tensors are the bad input here")
    with pytest.raises(ValueError, match=match):
        call()


@gpu
def test_binding_checks_name_the_argument():
    import flash_attn_2_cuda

    q = torch.randn(1, 8, 4, 64, device=DEVICE, dtype=torch.float16)
    k = torch.randn(1, 8, 3, 64, device=DEVICE, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="number of heads of k"):
        flash_attn_2_cuda.fwd(q, k, k, None, None, 0.0, 0.125, False, -1, -1, 0.0, False, None)
    with pytest.raises(RuntimeError, match="v must have the dtype of q"):
        flash_attn_2_cuda.fwd(q, q, q.bfloat16(), None, None, 0.0, 0.125, False, -1, -1, 0.0,
                              False, None)
    with pytest.raises(RuntimeError, match="head dim must be a multiple of 8"):
        x = torch.randn(1, 8, 4, 60, device=DEVICE, dtype=torch.float16)
        flash_attn_2_cuda.fwd(x, x, x, None, None, 0.0, 0.125, False, -1, -1, 0.0, False, None)


def test_reference_consistency_with_math():
    """Sanity of the test's own lse reference against a direct computation (CPU)."""
    q = torch.randn(1, 5, 2, 8)
    k = torch.randn(1, 7, 2, 8)
    lse = _lse_ref(q, k, 0.3, False, (-1, -1), 0.0, None)
    direct = torch.logsumexp(torch.einsum("bthd,bshd->bhts", q, k) * 0.3, -1)
    torch.testing.assert_close(lse, direct)
    lse_c = _lse_ref(q, k, 0.3, True, (-1, -1), 0.0, None)
    assert torch.isfinite(lse_c).all()
    assert math.isclose(lse_c[0, 0, 0].item(), torch.logsumexp(
        torch.einsum("hd,shd->hs", q[0, 0], k[0, :3]) * 0.3, -1)[0].item(), rel_tol=1e-5)
