import math

import pytest
import torch
import torch.nn.functional as F

from flash_attn.utils.testing import (
    attention_ref,
    attn_bias_from_alibi_slopes,
    construct_chunk_mask,
    construct_local_mask,
    dropout_mask_from_S_dmask,
    generate_qkv,
    generate_random_padding_mask,
    run_distributed,
)


def _sdpa(q, k, v, **kwargs):
    # SDPA wants (b, h, s, d).
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         **kwargs)
    return out.transpose(1, 2)


def _qkv(b, s_q, s_k, h, h_k, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s_q, h, d, generator=g, dtype=dtype),
            torch.randn(b, s_k, h_k, d, generator=g, dtype=dtype),
            torch.randn(b, s_k, h_k, d, generator=g, dtype=dtype))


def _close(a, b, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


# ---- against PyTorch SDPA where the two overlap ----

@pytest.mark.parametrize("s_q,s_k", [(5, 5), (3, 9), (9, 4)])
def test_matches_sdpa_no_mask(s_q, s_k):
    q, k, v = _qkv(2, s_q, s_k, 3, 3, 16)
    out, attn = attention_ref(q, k, v)
    _close(out, _sdpa(q, k, v))
    _close(attn.sum(-1), torch.ones(2, 3, s_q))
    _close(torch.einsum("bhts,bshd->bthd", attn, v), out)


def test_matches_sdpa_causal_square_and_custom_scale():
    q, k, v = _qkv(2, 7, 7, 2, 2, 8)
    _close(attention_ref(q, k, v, causal=True)[0], _sdpa(q, k, v, is_causal=True))
    _close(attention_ref(q, k, v, softmax_scale=0.3)[0], _sdpa(q, k, v, scale=0.3))
    _close(attention_ref(q, k, v, reorder_ops=True, softmax_scale=0.3)[0],
           _sdpa(q, k, v, scale=0.3))


def test_matches_sdpa_gqa_by_repeating_heads():
    q, k, v = _qkv(2, 5, 6, 6, 2, 8)
    out, _ = attention_ref(q, k, v)
    # Query head j reads kv head j // 3.
    k_rep = torch.stack([k[:, :, j // 3] for j in range(6)], dim=2)
    v_rep = torch.stack([v[:, :, j // 3] for j in range(6)], dim=2)
    _close(out, _sdpa(q, k_rep, v_rep))
    _close(attention_ref(q, k_rep, v_rep, causal=True)[0],
           attention_ref(q, k, v, causal=True)[0])


@pytest.mark.parametrize("bias_shape", [(2, 3, 4, 6), (1, 3, 1, 6), (4, 6)])
def test_matches_sdpa_attn_bias(bias_shape):
    q, k, v = _qkv(2, 4, 6, 3, 3, 8)
    bias = torch.randn(bias_shape)
    _close(attention_ref(q, k, v, attn_bias=bias)[0], _sdpa(q, k, v, attn_mask=bias))


# ---- masks by hand ----

def test_construct_local_mask_by_hand():
    T, F_ = True, False
    # causal, s_q < s_k: bottom-right alignment, query i sees keys j <= i + 2.
    causal = construct_local_mask(2, 4, (-1, 0))
    assert causal.shape == (1, 1, 2, 4)
    assert causal[0, 0].tolist() == [[F_, F_, F_, T], [F_, F_, F_, F_]]
    # window (1, 0), s_q == s_k: query i sees keys i - 1 and i.
    assert construct_local_mask(4, 4, (1, 0))[0, 0].tolist() == [
        [F_, T, T, T], [F_, F_, T, T], [T, F_, F_, T], [T, T, F_, F_]]
    # window (0, 1) with s_q > s_k: query i sees keys i - 2 and i - 1.
    assert construct_local_mask(3, 2, (0, 1))[0, 0].tolist() == [[F_, T], [F_, F_], [T, F_]]
    # no bounds: nothing masked
    assert not construct_local_mask(3, 5).any()


def test_construct_local_mask_uses_per_batch_lengths_and_leftpad():
    qpm = torch.tensor([[True, True, True], [True, False, False]])
    kpm = torch.tensor([[True, True, True, True], [True, True, False, False]])
    m = construct_local_mask(3, 4, (-1, 0), qpm, kpm)
    assert m.shape == (2, 1, 3, 4)
    assert m[0, 0, 0].tolist() == [False, False, True, True]   # sq=3, sk=4: j <= i + 1
    assert m[1, 0, 0].tolist() == [False, False, True, True]   # sq=1, sk=2: j <= i + 1
    # key_leftpad: keys before it are masked, positions count from it.
    leftpad = torch.tensor([0, 2])
    kpm_lp = torch.tensor([[True, True, True, False], [False, False, True, True]])
    m = construct_local_mask(1, 4, (0, 0), None, kpm_lp, key_leftpad=leftpad)
    assert m[0, 0, 0].tolist() == [True, True, False, True]   # sk=3: sees position 2
    assert m[1, 0, 0].tolist() == [True, True, True, False]   # sk=2: position 1 = index 3


def test_construct_chunk_mask_by_hand():
    T, F_ = True, False
    # s_q == s_k, chunks of 2: queries 0, 1 see keys 0, 1; queries 2, 3 see keys 2, 3.
    m = construct_chunk_mask(4, 4, 2)
    assert m.shape == (1, 1, 4, 4)
    assert m[0, 0].tolist() == [[F_, F_, T, T], [F_, F_, T, T], [T, T, F_, F_], [T, T, F_, F_]]
    # s_q < s_k: query i aligns with key i + 3 and sees that key's chunk.
    assert construct_chunk_mask(2, 5, 2)[0, 0].tolist() == [
        [T, T, F_, F_, T], [T, T, T, T, F_]]
    # s_q > s_k: query 0 aligns with key -1, a chunk with no key: it sees nothing.
    assert construct_chunk_mask(3, 2, 2)[0, 0].tolist() == [[T, T], [F_, F_], [F_, F_]]
    # a chunk as long as the keys: nothing masked
    assert not construct_chunk_mask(3, 4, 4).any()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="attention_chunk"):
            construct_chunk_mask(3, 4, bad)


def test_construct_chunk_mask_uses_per_batch_lengths_and_leftpad():
    qpm = torch.tensor([[True, True, True], [True, False, False]])
    kpm = torch.tensor([[True] * 5, [True, True, True, False, False]])
    m = construct_chunk_mask(3, 5, 2, qpm, kpm)
    assert m.shape == (2, 1, 3, 5)
    # sample 0: sq=3, sk=5, query 0 aligns with key 2 -> chunk [2, 4)
    assert m[0, 0, 0].tolist() == [True, True, False, False, True]
    # sample 1: sq=1, sk=3, query 0 aligns with key 2 -> chunk [2, 4)
    assert m[1, 0, 0].tolist() == [True, True, False, False, True]
    # key_leftpad 2: keys 0, 1 masked, positions count from key 2; sk=3 so query 0 of 1 aligns
    # with position 2, chunk [2, 4) = keys 4, 5.
    m = construct_chunk_mask(1, 6, 2, None, torch.tensor([[False, False, True, True, True, False]]),
                             key_leftpad=torch.tensor([2]))
    assert m[0, 0, 0].tolist() == [True, True, True, True, False, False]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [3, 4])
def test_attention_chunk_equals_attention_within_each_chunk(causal, chunk):
    """With s_q == s_k, chunked attention is plain attention run on each chunk on its own."""
    q, k, v = _qkv(2, 10, 10, 4, 2, 8)
    out, attn = attention_ref(q, k, v, causal=causal, attention_chunk=chunk)
    for start in range(0, 10, chunk):
        rows = slice(start, start + chunk)
        expected, expected_attn = attention_ref(q[:, rows], k[:, rows], v[:, rows], causal=causal)
        _close(out[:, rows], expected)
        _close(attn[:, :, rows, rows], expected_attn)
        assert attn[:, :, rows, :start].eq(0).all() and attn[:, :, rows, start + chunk:].eq(0).all()


def test_alibi_bias_values():
    slopes = torch.tensor([1.0, 0.5])
    bias = attn_bias_from_alibi_slopes(slopes, 2, 3)
    assert bias.dtype == torch.float32 and bias.shape == (1, 2, 2, 3)
    # query i aligns with key i + 1
    assert bias[0, 0].tolist() == [[-1.0, 0.0, -1.0], [-2.0, -1.0, 0.0]]
    assert bias[0, 1].tolist() == [[-0.5, 0.0, -0.5], [-1.0, -0.5, 0.0]]
    per_batch = attn_bias_from_alibi_slopes(torch.tensor([[1.0], [2.0]]), 1, 2,
                                            key_padding_mask=torch.tensor([[1, 1], [1, 0]]))
    assert per_batch.shape == (2, 1, 1, 2)
    assert per_batch[:, 0, 0].tolist() == [[-1.0, 0.0], [0.0, -2.0]]


def test_alibi_softcap_and_leftpad_by_hand():
    # d = 1, scale 1: scores are q * k.
    q = torch.tensor([2.0]).view(1, 1, 1, 1)
    k = torch.tensor([1.0, 0.0, 0.5]).view(1, 3, 1, 1)
    v = torch.tensor([1.0, 10.0, 100.0]).view(1, 3, 1, 1)
    # softcap 1: scores [tanh 2, 0, tanh 1]
    _, attn = attention_ref(q, k, v, softcap=1.0, softmax_scale=1.0)
    _close(attn[0, 0, 0], torch.softmax(torch.tensor([math.tanh(2), 0.0, math.tanh(1)]), 0))
    # alibi slope 1, one query aligned with the last key: bias [-2, -1, 0] after the softcap
    out, attn = attention_ref(q, k, v, softcap=1.0, softmax_scale=1.0,
                              alibi_slopes=torch.tensor([1.0]))
    p = torch.softmax(torch.tensor([math.tanh(2) - 2, -1.0, math.tanh(1)]), 0)
    _close(attn[0, 0, 0], p)
    _close(out[0, 0, 0, 0], p @ torch.tensor([1.0, 10.0, 100.0]))
    # key_leftpad 1: key 0 is invalid, keys 1, 2 are positions 0, 1; alibi distance [1, 0].
    out, attn = attention_ref(q, k, v, softmax_scale=1.0, alibi_slopes=torch.tensor([1.0]),
                              key_leftpad=torch.tensor([1]))
    p = torch.softmax(torch.tensor([-1.0, 1.0]), 0)
    _close(attn[0, 0, 0], torch.cat([torch.zeros(1), p]))
    # window (0, 0) with leftpad: only the aligned key (index 2) remains
    out, attn = attention_ref(q, k, v, window_size=(0, 0), key_leftpad=torch.tensor([1]))
    _close(attn[0, 0, 0], torch.tensor([0.0, 0.0, 1.0]))
    _close(out[0, 0, 0, 0], torch.tensor(100.0))


def test_causal_bottom_right_with_more_queries_than_keys():
    q, k, v = _qkv(1, 4, 2, 1, 1, 4)
    q.requires_grad_()
    out, attn = attention_ref(q, k, v, causal=True)
    # query i sees keys j <= i - 2: rows 0, 1 see nothing, row 2 sees key 0, row 3 both keys.
    assert attn[0, 0, :2].eq(0).all() and out[0, :2].eq(0).all()
    _close(attn[0, 0, 2], torch.tensor([1.0, 0.0]))
    _close(out[0, 2, 0], v[0, 0, 0])
    _close(attn[0, 0, 3], torch.softmax(attn.new_tensor(
        [(q[0, 3, 0] @ k[0, j, 0]).item() / 2.0 for j in range(2)]), 0))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad[0, :3].eq(0).all()


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q, k, v = _qkv(2, 3, 4, 2, 2, 8)
    for t in (q, k, v):
        t.requires_grad_()
    kpm = torch.tensor([[True, True, False, False], [False, False, False, False]])
    bias = torch.zeros(2, 2, 3, 4)
    bias[0, 1, 2] = float("-inf")  # an all -inf bias row counts as fully masked too
    out, attn = attention_ref(q, k, v, key_padding_mask=kpm, attn_bias=bias)
    assert torch.isfinite(out).all() and torch.isfinite(attn).all()
    assert out[1].eq(0).all() and attn[1].eq(0).all()
    assert attn[0, 1, 2].eq(0).all() and out[0, 2, 1].eq(0).all()
    _close(attn[0, 0].sum(-1), torch.ones(3))
    assert attn[0, :, :, 2:].eq(0).all()
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert k.grad[1].eq(0).all() and k.grad[0, 2:].eq(0).all() and q.grad[1].eq(0).all()


def test_query_padding_zeroes_padded_rows():
    q, k, v = _qkv(2, 4, 4, 2, 2, 8)
    qpm = torch.tensor([[True, True, True, True], [True, True, False, False]])
    out, attn = attention_ref(q, k, v, query_padding_mask=qpm)
    assert out[1, 2:].eq(0).all() and attn[1, :, 2:].eq(0).all()
    _close(out[:, :2], attention_ref(q[:, :2], k, v)[0][:, :2])


def test_gqa_head_mapping_by_hand():
    q = torch.randn(1, 3, 4, 8)
    k = torch.randn(1, 5, 2, 8)
    v = torch.ones(1, 5, 2, 8) * torch.tensor([1.0, 2.0]).view(1, 1, 2, 1)
    out, _ = attention_ref(q, k, v)
    # heads 0, 1 use kv head 0 (value 1); heads 2, 3 use kv head 1 (value 2)
    _close(out[0, :, :, 0], torch.tensor([[1.0, 1.0, 2.0, 2.0]]).expand(3, 4))
    with pytest.raises(ValueError, match="k"):
        attention_ref(q, torch.randn(1, 5, 3, 8), torch.randn(1, 5, 3, 8))


def test_dropout_mask_scaling():
    # q = 0: uniform attention over 2 keys; drop key 1 at p = 0.5 -> 0.5 * 2 * v0 = v0.
    q = torch.zeros(1, 1, 1, 4)
    k = torch.randn(1, 2, 1, 4)
    v = torch.randn(1, 2, 1, 4)
    keep = torch.tensor([True, False]).view(1, 1, 1, 2)
    out, attn = attention_ref(q, k, v, dropout_p=0.5, dropout_mask=keep)
    _close(out[0, 0, 0], v[0, 0, 0])
    _close(attn[0, 0, 0], torch.tensor([0.5, 0.5]))  # attention is reported before dropout
    q, k, v = _qkv(2, 5, 6, 3, 3, 8)
    keep = torch.rand(2, 3, 5, 6) > 0.3
    out, attn = attention_ref(q, k, v, dropout_p=0.3, dropout_mask=keep)
    _close(out, torch.einsum("bhts,bshd->bthd", attn * keep / 0.7, v))
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_ref(q, k, v, dropout_p=0.3)


def test_dropout_mask_from_S_dmask():
    S_dmask = torch.tensor([[0.1, -0.2, 0.0], [-0.0, 0.3, -0.5]]).view(1, 1, 2, 3)
    S_dmask = F.pad(S_dmask, (0, 125, 0, 126), value=-1.0)  # the kernels round up to 128
    keep = dropout_mask_from_S_dmask(S_dmask, 2, 3)
    assert keep.shape == (1, 1, 2, 3) and keep.dtype == torch.bool
    assert keep[0, 0].tolist() == [[True, False, True], [True, True, False]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_upcast_false_computes_in_low_precision(dtype):
    q, k, v = _qkv(2, 64, 64, 2, 2, 32, dtype=dtype)
    exact, _ = attention_ref(q.double(), k.double(), v.double(), causal=True)
    out_up, attn_up = attention_ref(q, k, v, causal=True)
    out_lp, attn_lp = attention_ref(q, k, v, causal=True, upcast=False)
    out_re, _ = attention_ref(q, k, v, causal=True, upcast=False, reorder_ops=True)
    assert out_up.dtype == out_lp.dtype == attn_up.dtype == attn_lp.dtype == dtype
    # Mean errors: fp32 math leaves only the output rounding (~2.3x less error on this data);
    # low-precision math also rounds scores, probabilities and the sums.
    err_up = (out_up.double() - exact).abs().mean().item()
    err_lp = (out_lp.double() - exact).abs().mean().item()
    err_re = (out_re.double() - exact).abs().mean().item()
    assert 1.5 * err_up < err_lp < 5 * err_up
    assert 1.5 * err_up < err_re < 5 * err_up and not torch.equal(out_lp, out_re)


# ---- an independent loop implementation for feature combinations ----

def _naive(q, k, v, qpm, kpm, causal, window, softcap, slopes, leftpad, scale):
    """Element by element from the spec, float64."""
    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    out = torch.zeros(b, s_q, h, d, dtype=torch.float64)
    attn = torch.zeros(b, h, s_q, s_k, dtype=torch.float64)
    left, right = (window[0], 0) if causal else window
    for bi in range(b):
        lp = 0 if leftpad is None else int(leftpad[bi])
        valid_k = [j for j in range(s_k) if j >= lp and (kpm is None or bool(kpm[bi, j]))]
        sk = len(valid_k)
        sq = s_q if qpm is None else int(qpm[bi].sum())
        for hi in range(h):
            kh = hi // (h // h_k)
            for i in range(s_q):
                if qpm is not None and not qpm[bi, i]:
                    continue
                diag = i + sk - sq
                keys, scores = [], []
                for j in valid_k:
                    pos = j - lp
                    if (left >= 0 and pos < diag - left) or (right >= 0 and pos > diag + right):
                        continue
                    s = float(q[bi, i, hi].double() @ k[bi, j, kh].double()) * scale
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        slope = float(slopes[hi] if slopes.dim() == 1 else slopes[bi, hi])
                        s -= slope * abs(diag - pos)
                    keys.append(j)
                    scores.append(s)
                if not keys:
                    continue
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                for j, wj in zip(keys, w):
                    attn[bi, hi, i, j] = wj / sum(w)
                    out[bi, i, hi] += attn[bi, hi, i, j] * v[bi, j, kh].double()
    return out, attn


CASES = [
    # b, s_q, s_k, h, h_k, causal, window, softcap, alibi, q_pad, k_pad, leftpad
    (2, 3, 5, 2, 2, True, (-1, -1), 0.0, None, False, False, False),
    (2, 5, 3, 2, 1, True, (-1, -1), 0.0, None, False, False, False),
    (2, 4, 6, 2, 2, False, (2, 1), 0.0, None, False, False, False),
    (2, 6, 4, 4, 2, False, (0, -1), 0.0, None, False, False, False),
    (2, 4, 4, 2, 2, False, (-1, 1), 2.0, "h", False, False, False),
    (2, 3, 6, 2, 1, True, (2, -1), 0.0, "bh", False, False, False),
    (3, 5, 6, 2, 2, True, (-1, -1), 0.0, None, True, True, False),
    (3, 5, 6, 2, 2, False, (1, 2), 3.0, "bh", True, True, False),
    (2, 2, 7, 2, 1, True, (-1, -1), 0.0, "h", False, True, True),
    (2, 3, 7, 2, 2, False, (1, 0), 1.5, None, False, False, True),
]


@pytest.mark.parametrize("seed,case", list(enumerate(CASES)))
def test_matches_loop_reference(seed, case):
    b, s_q, s_k, h, h_k, causal, window, softcap, alibi, q_pad, k_pad, use_leftpad = case
    q, k, v = _qkv(b, s_q, s_k, h, h_k, 4, seed=seed)
    g = torch.Generator().manual_seed(1)
    slopes = {None: None, "h": torch.rand(h, generator=g),
              "bh": torch.rand(b, h, generator=g)}[alibi]
    leftpad = torch.tensor([1, 3, 0][:b]) if use_leftpad else None
    qpm = kpm = None
    if q_pad:
        qpm = torch.arange(s_q) < torch.tensor([s_q, 2, 1][:b]).unsqueeze(1)
    if k_pad:
        first = leftpad if leftpad is not None else torch.zeros(b, dtype=torch.long)
        lengths = torch.tensor([s_k - 3, 2, s_k][:b]).clamp(max=s_k - first)
        kpm = (torch.arange(s_k) >= first.unsqueeze(1)) & (
            torch.arange(s_k) < (first + lengths).unsqueeze(1))
    out, attn = attention_ref(q, k, v, qpm, kpm, causal=causal, window_size=window,
                              softcap=softcap, alibi_slopes=slopes, key_leftpad=leftpad)
    exp_out, exp_attn = _naive(q, k, v, qpm, kpm, causal, window, softcap, slopes, leftpad,
                               1 / math.sqrt(4))
    _close(attn.double(), exp_attn)
    _close(out.double(), exp_out)
    assert torch.isfinite(out).all()
    if kpm is not None and leftpad is not None:
        # A key mask that also covers the left padding means the same: leftpad wins.
        prefix_kpm = torch.arange(s_k) < (leftpad + kpm.sum(-1)).unsqueeze(1)
        out2, attn2 = attention_ref(q, k, v, qpm, prefix_kpm, causal=causal, window_size=window,
                                    softcap=softcap, alibi_slopes=slopes, key_leftpad=leftpad)
        _close(attn2, attn)
        _close(out2, out)


# ---- padding masks and varlen inputs ----

def test_generate_random_padding_mask():
    torch.manual_seed(0)
    full = generate_random_padding_mask(50, 4, "cpu", mode="full")
    assert full.dtype == torch.bool and full.shape == (4, 50) and full.all()
    for mode, low in (("random", 30), ("third", 16)):
        m = generate_random_padding_mask(50, 64, "cpu", mode=mode)
        lengths = m.sum(-1)
        assert lengths.min() >= low and lengths.max() <= 50 and len(set(lengths.tolist())) > 3
        assert torch.equal(m, torch.arange(50) < lengths.unsqueeze(1))  # prefix
    small = generate_random_padding_mask(5, 64, "cpu", mode="random").sum(-1)
    assert small.min() >= 1 and small.max() <= 5
    zero = generate_random_padding_mask(40, 7, "cpu", zero_lengths=True).sum(-1)
    assert zero[[0, 5, 6]].eq(0).all() and zero[1:5].gt(0).all()
    with pytest.raises(ValueError, match="mode"):
        generate_random_padding_mask(8, 2, "cpu", mode="half")


def _check_leaves(*tensors):
    for t in tensors:
        assert t.is_leaf and t.requires_grad


def test_generate_qkv_unpacked_round_trip_and_varlen_semantics():
    torch.manual_seed(0)
    b, s_q, s_k, h, h_k, d = 3, 6, 8, 4, 2, 8
    q, k, v = _qkv(b, s_q, s_k, h, h_k, d)
    qpm = generate_random_padding_mask(s_q, b, "cpu", mode="third")
    kpm = generate_random_padding_mask(s_k, b, "cpu", mode="third")
    (q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, q2, k2, v2,
     output_pad_fn, dq_pad_fn, dk_pad_fn) = generate_qkv(q, k, v, qpm, kpm)
    _check_leaves(q_unpad, k_unpad, v_unpad, q2, k2, v2)
    assert cu_q.dtype == cu_k.dtype == torch.int32
    assert cu_q.tolist() == [0] + qpm.sum(-1).cumsum(0).tolist()
    assert max_q == qpm.sum(-1).max().item() and max_k == kpm.sum(-1).max().item()
    assert q_unpad.shape == (qpm.sum().item(), h, d) and k_unpad.shape == (kpm.sum().item(), h_k, d)
    _close(output_pad_fn(q_unpad), q * qpm[..., None, None], atol=0, rtol=0)
    _close(dq_pad_fn(q_unpad), q * qpm[..., None, None], atol=0, rtol=0)
    _close(dk_pad_fn(v_unpad), v * kpm[..., None, None], atol=0, rtol=0)
    # What a varlen kernel must compute: attention per packed sequence == padded reference.
    out_ref, _ = attention_ref(q2, k2, v2, qpm, kpm, causal=True)
    pieces = []
    for i in range(b):
        qs = q_unpad[cu_q[i]:cu_q[i + 1]].unsqueeze(0)
        ks = k_unpad[cu_k[i]:cu_k[i + 1]].unsqueeze(0)
        vs = v_unpad[cu_k[i]:cu_k[i + 1]].unsqueeze(0)
        pieces.append(attention_ref(qs, ks, vs, causal=True)[0][0])
    _close(output_pad_fn(torch.cat(pieces)), out_ref)
    out_ref.sum().backward()  # the returned leaves take gradients
    assert q2.grad is not None and torch.isfinite(k2.grad).all()


def test_generate_qkv_packed_and_unmasked():
    b, s, h, d = 2, 5, 2, 4
    q, k, v = _qkv(b, s, s, h, h, d)
    mask = generate_random_padding_mask(s, b, "cpu", mode="third")
    q_unpad, kv_unpad, cu_q, cu_k, max_q, max_k, q2, kv, out_fn, dq_fn, dkv_fn = generate_qkv(
        q, k, v, mask, mask, kvpacked=True)
    _check_leaves(q_unpad, kv_unpad, q2, kv)
    assert kv.shape == (b, s, 2, h, d) and kv_unpad.shape == (mask.sum().item(), 2, h, d)
    _close(dkv_fn(kv_unpad)[:, :, 1], v * mask[..., None, None], atol=0, rtol=0)
    qkv_unpad, cu, max_s, qkv, out_fn, dqkv_fn = generate_qkv(q, k, v, mask, mask, qkvpacked=True)
    _check_leaves(qkv_unpad, qkv)
    assert qkv.shape == (b, s, 3, h, d) and torch.equal(cu, cu_q) and max_s == max_q
    _close(dqkv_fn(qkv_unpad)[:, :, 0], q * mask[..., None, None], atol=0, rtol=0)
    other = mask.clone()
    other[0, 0] = ~other[0, 0]  # differs from mask whatever the random draw gave
    with pytest.raises(ValueError, match="query_padding_mask"):
        generate_qkv(q, k, v, mask, other, qkvpacked=True)
    # Without masks everything is one full-length sequence per batch.
    q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, *_, out_fn, _, _ = generate_qkv(q, k, v)
    assert cu_q.dtype == torch.int32 and cu_q.tolist() == [0, 5, 10] and max_q == max_k == 5
    _close(out_fn(q_unpad), q, atol=0, rtol=0)


@pytest.mark.gpu
def test_reference_on_cuda_matches_cpu():
    q, k, v = _qkv(2, 33, 47, 4, 2, 16)
    kpm = generate_random_padding_mask(47, 2, "cpu", mode="third")
    slopes = torch.rand(4)
    cpu = attention_ref(q, k, v, key_padding_mask=kpm, causal=True, alibi_slopes=slopes,
                        softcap=5.0)
    gpu = attention_ref(q.cuda(), k.cuda(), v.cuda(), key_padding_mask=kpm.cuda(), causal=True,
                        alibi_slopes=slopes.cuda(), softcap=5.0)
    for a, b in zip(cpu, gpu):
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-5)


# ---- run_distributed: the launcher of the multi-process tests ----

def _rank_sum(rank, world, offset):
    import os

    import torch.distributed as dist

    x = torch.tensor([float(rank + offset)])
    dist.all_reduce(x)
    print(f"rank {rank}/{world} sum {x.item():g} interpret {os.environ.get('TRITON_INTERPRET')} "
          f"threads {torch.get_num_threads()}", flush=True)


def _rank_one_fails(rank, world):
    if rank == 1:
        raise RuntimeError("rank one broke on purpose")
    import torch.distributed as dist

    dist.barrier()  # never met: the launcher must stop this rank instead of waiting


def test_run_distributed_returns_each_rank_output():
    outputs = run_distributed(_rank_sum, world_size=2, args=(10,))
    assert [out.strip() for out in outputs] == [
        f"rank {r}/2 sum 21 interpret 1 threads 1" for r in range(2)]


def test_run_distributed_fails_with_the_child_traceback():
    with pytest.raises(pytest.fail.Exception) as info:
        run_distributed(_rank_one_fails, world_size=2, timeout=120)
    message = str(info.value)
    assert "_rank_one_fails on 2 gloo ranks failed" in message
    assert "RuntimeError: rank one broke on purpose" in message and "Traceback" in message
    with pytest.raises(ValueError, match="module-level"):
        run_distributed(lambda rank, world: None)


def test_check_error_rule_passes_and_fails_as_stated():
    from flash_attn.utils.testing import check_error_rule

    ref = torch.zeros(4)
    lowp = torch.tensor([0.0, 0.1, 0.0, 0.0])  # reference-in-dtype error 0.1
    check_error_rule("ok", torch.tensor([0.0, 0.0, 0.2, 0.0]), ref, lowp, slack=0.0)
    with pytest.raises(AssertionError, match="too far: max error"):
        check_error_rule("too far", torch.tensor([0.0, 0.0, 0.21, 0.0]), ref, lowp, slack=0.0)
    with pytest.raises(AssertionError, match="has NaN"):
        check_error_rule("nan", torch.tensor([float("nan"), 0, 0, 0]), ref, lowp)


def test_heads_for():
    from flash_attn.utils.testing import heads_for

    assert heads_for("mha") == (6, 6) and heads_for("gqa") == (6, 2) and heads_for("mqa", 4) == (4, 1)
