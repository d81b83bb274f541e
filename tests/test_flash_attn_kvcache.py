"""flash_attn_with_kvcache: the kernels against the fp32 reference of flash_attn.utils.testing
(flash-attn's error rule), and the cache after the in-place append compared exactly.

A case draws its options from the whole space (seeded, so reproducible): batch, query length
(decode and chunked prefill), new keys, cache lengths per row (0 and full included), contiguous
cache with or without cache_batch_idx or a paged one with a shuffled block table (page sizes 16 to
256, not only powers of two), left padding, rotary (interleaved or not, partial), causal / local,
softcap, ALiBi, GQA/MQA, head dims 40 to 256, fp16/bf16 and num_splits 1 / auto / many.
"""

import random

import pytest
import torch

from flash_attn import flash_attn_with_kvcache
from flash_attn.ops.triton.rotary import apply_rotary
from flash_attn.utils.testing import attention_ref, check_error_rule, rotary_tables

DEVICE = "cuda"
SLACK = 1e-5
gpu = pytest.mark.gpu


def draw_case(seed):
    rng = random.Random(seed)
    nheads, nheads_k = rng.choice([(6, 6), (6, 2), (6, 1), (32, 8)])
    seqlen_cache = rng.choice([16, 113, 300, 1024])
    rotary = rng.choice([None, None, "halves", "interleaved"])
    return dict(
        batch=rng.choice([1, 3, 5]),
        # Queries no longer than the cache (the rotary tables cover the cache's positions).
        seqlen_q=min(rng.choice([1, 1, 1, 2, 7, 64]), seqlen_cache),
        # Rotary rotates the new keys, so it comes with some.
        seqlen_new=rng.choice([1, 1, 3] if rotary else [0, 1, 1, 3]),
        seqlen_cache=seqlen_cache,
        nheads=nheads, nheads_k=nheads_k,
        head_dim=rng.choice([40, 64, 96, 128, 128, 192, 256]),
        dtype=rng.choice([torch.bfloat16, torch.bfloat16, torch.float16]),
        paged=rng.random() < 0.4,
        page_block_size=rng.choice([16, 48, 64, 256]),
        batch_idx=rng.random() < 0.3,
        leftpad=rng.random() < 0.25,
        rotary=rotary,
        rotary_fraction=rng.choice([0.5, 1.0]),
        mask=rng.choice(["none", "causal", "causal", "local"]),
        softcap=rng.choice([0.0, 0.0, 0.0, 15.0]),
        alibi=rng.random() < 0.2,
        num_splits=rng.choice([1, 0, 0, 5]),
        lengths_seed=rng.randrange(1 << 30),
    )


def make_inputs(case):
    """The tensors of a case; the cache holds random keys everywhere (NaN-free) and each row's
    length is drawn so that the appended keys fit, 0 and the maximum included."""
    g = torch.Generator().manual_seed(case["lengths_seed"])
    b, sq, snew, sc = case["batch"], case["seqlen_q"], case["seqlen_new"], case["seqlen_cache"]
    h, hk, d, dtype = case["nheads"], case["nheads_k"], case["head_dim"], case["dtype"]
    lengths = torch.randint(0, sc - snew + 1, (b,), generator=g)
    lengths[0] = sc - snew  # a full cache
    if b > 1:
        lengths[1] = 0  # an empty one
    leftpad = None
    if case["leftpad"]:
        leftpad = (torch.rand(b, generator=g) * lengths).long()
    rows = b + 2 if case["batch_idx"] else b
    full_k = torch.randn(rows, sc, hk, d, generator=g).to(DEVICE, dtype)
    full_v = torch.randn(rows, sc, hk, d, generator=g).to(DEVICE, dtype)
    batch_idx = torch.randperm(rows, generator=g)[:b] if case["batch_idx"] else torch.arange(b)
    q = torch.randn(b, sq, h, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, snew, hk, d, generator=g).to(DEVICE, dtype) if snew else None
    v = torch.randn(b, snew, hk, d, generator=g).to(DEVICE, dtype) if snew else None
    return dict(q=q, k=k, v=v, full_k=full_k, full_v=full_v, lengths=lengths.to(torch.int32),
                leftpad=None if leftpad is None else leftpad.to(torch.int32), batch_idx=batch_idx)


def to_paged(full_k, full_v, page_block_size, generator):
    """(b, s, h, d) caches -> pages (num_blocks, page, h, d) of both, in one shuffled order (the
    block table), with random keys in the pages no row uses."""
    b, s = full_k.shape[:2]
    blocks_per_row = -(-s // page_block_size)
    num_blocks = b * blocks_per_row + 3
    table = torch.randperm(num_blocks, generator=generator)[: b * blocks_per_row].view(b, -1)
    pages = []
    for full in (full_k, full_v):
        paged = torch.randn(num_blocks, page_block_size, *full.shape[2:], generator=generator)
        paged = paged.to(full)
        padded = torch.nn.functional.pad(full, (0, 0, 0, 0, 0, blocks_per_row * page_block_size - s))
        paged[table.flatten()] = padded.reshape(b * blocks_per_row, page_block_size, *full.shape[2:])
        pages.append(paged)
    return pages[0], pages[1], table.to(full_k.device, torch.int32)


def from_paged(pages, table, seqlen):
    b = table.shape[0]
    return pages[table.long()].reshape(b, -1, *pages.shape[2:])[:, :seqlen]


def run_case(case):
    torch.manual_seed(0)
    inputs = make_inputs(case)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    b, sq, h, d = q.shape
    snew, sc, dtype = case["seqlen_new"], case["seqlen_cache"], case["dtype"]
    lengths, leftpad, batch_idx = inputs["lengths"], inputs["leftpad"], inputs["batch_idx"]
    causal = case["mask"] == "causal"
    window = (-1, -1)
    if case["mask"] == "local":
        window = (random.Random(case["lengths_seed"]).randrange(0, sc), 0)
        causal = False
    cos = sin = None
    if case["rotary"] is not None:
        rotary_dim = int(d * case["rotary_fraction"]) // 16 * 16 or 16
        capacity = -(-sc // case["page_block_size"]) * case["page_block_size"] if case["paged"] else sc
        cos, sin = rotary_tables(capacity, rotary_dim, DEVICE, dtype=dtype)
    alibi = (torch.rand(b, h, device=DEVICE) * 0.3) if case["alibi"] else None

    # The caches as the call sees them, and the per-entry view of them the reference reads.
    g = torch.Generator().manual_seed(case["lengths_seed"] + 1)
    entry_k, entry_v = inputs["full_k"][batch_idx], inputs["full_v"][batch_idx]
    block_table = cache_batch_idx = None
    if case["paged"]:
        k_cache, v_cache, block_table = to_paged(entry_k, entry_v, case["page_block_size"], g)
    else:
        k_cache, v_cache = inputs["full_k"].clone(), inputs["full_v"].clone()
        if case["batch_idx"]:
            cache_batch_idx = batch_idx.to(DEVICE, torch.int32)
    k_cache_before, v_cache_before = k_cache.clone(), v_cache.clone()
    cache_seqlens = lengths.to(DEVICE)
    lp = None if leftpad is None else leftpad.to(DEVICE)

    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=lp, block_table=block_table,
        causal=causal, window_size=window, softcap=case["softcap"],
        rotary_interleaved=case["rotary"] == "interleaved", alibi_slopes=alibi,
        num_splits=case["num_splits"], return_softmax_lse=True)

    # The append: new keys (rotated) at rows lengths[b] .. + snew of each entry, nothing else.
    k_rot = k
    if k is not None and cos is not None:
        k_rot = apply_rotary(k, cos, sin, seqlen_offsets=cache_seqlens,
                             interleaved=case["rotary"] == "interleaved")
    expected_k, expected_v = entry_k.clone(), entry_v.clone()
    for row in range(b):
        n = int(lengths[row])
        if snew:
            expected_k[row, n:n + snew] = k_rot[row]
            expected_v[row, n:n + snew] = v[row]
    if case["paged"]:
        got_k, got_v = from_paged(k_cache, block_table, sc), from_paged(v_cache, block_table, sc)
        used = torch.zeros(k_cache.shape[0], dtype=torch.bool)
        used[block_table.long().flatten().cpu()] = True
        unused = ~used.to(DEVICE)
        assert torch.equal(k_cache[unused], k_cache_before[unused])
        assert torch.equal(v_cache[unused], v_cache_before[unused])
    else:
        got_k, got_v = k_cache[batch_idx], v_cache[batch_idx]
        untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
        untouched[batch_idx] = False
        untouched = untouched.to(DEVICE)
        assert torch.equal(k_cache[untouched], k_cache_before[untouched])
        assert torch.equal(v_cache[untouched], v_cache_before[untouched])
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v), "the append"

    # The reference: q rotated (per token when causal or local, else all at the cache length),
    # attention over each entry's keys [leftpad, lengths + snew).
    # (The rotation itself is the rotary kernel's, tested against apply_rotary_ref elsewhere:
    # here the positions are what is checked.)
    q_ref = q
    if cos is not None:
        interleaved = case["rotary"] == "interleaved"
        if causal or window != (-1, -1):
            q_ref = apply_rotary(q, cos, sin, seqlen_offsets=cache_seqlens, interleaved=interleaved)
        else:
            folded = q.reshape(b, 1, sq * h, d)
            q_ref = apply_rotary(folded, cos, sin, seqlen_offsets=cache_seqlens,
                                 interleaved=interleaved).reshape(b, sq, h, d)
    key_padding_mask = torch.arange(sc, device=DEVICE)[None] < (cache_seqlens + snew)[:, None]
    kwargs = dict(key_padding_mask=key_padding_mask, causal=causal, window_size=window,
                  softcap=case["softcap"], alibi_slopes=alibi, key_leftpad=lp)
    out_ref, _ = attention_ref(q_ref, expected_k, expected_v, **kwargs)
    out_pt, _ = attention_ref(q_ref, expected_k, expected_v, upcast=False, reorder_ops=True,
                              **kwargs)
    check_error_rule("out", out, out_ref, out_pt, SLACK)
    assert lse.shape == (b, h, sq) and not lse.isnan().any()
    return out, lse


CASES = [draw_case(seed) for seed in range(96)]


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_kvcache_against_reference(case):
    run_case(case)


@gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q,nheads,nheads_k", [(1, 32, 8), (1, 8, 8), (5, 6, 2)])
def test_num_splits_agree(paged, seqlen_q, nheads, nheads_k):
    """num_splits 1, 2, auto and many give the same result within the rule, and the same lse."""
    base = dict(batch=2, seqlen_q=seqlen_q, seqlen_new=1, seqlen_cache=2000, nheads=nheads,
                nheads_k=nheads_k, head_dim=128, dtype=torch.bfloat16, paged=paged,
                page_block_size=64, batch_idx=False, leftpad=False, rotary=None,
                rotary_fraction=1.0, mask="causal", softcap=0.0, alibi=False, lengths_seed=7)
    results = [run_case(dict(base, num_splits=n)) for n in (1, 2, 0, 40)]
    out_1, lse_1 = results[0]
    for out, lse in results[1:]:
        torch.testing.assert_close(lse, lse_1, rtol=0, atol=1e-4)
        assert (out.float() - out_1.float()).abs().max().item() < 1e-2


@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,nheads,nheads_k", [(1, 32, 8), (64, 6, 2), (65, 6, 2)])
@pytest.mark.parametrize("paged,page_block_size", [(False, 16), (True, 16), (True, 48)])
def test_decode_tile_boundary(head_dim, seqlen_q, nheads, nheads_k, paged, page_block_size):
    """Both sides of the switch to the 64-row decode tile (at most 64 unmasked query rows, a
    GQA group's heads packed as rows for one query), with pages shorter than its key block and
    rows that straddle pages (48), against the reference."""
    run_case(dict(batch=3, seqlen_q=seqlen_q, seqlen_new=1, seqlen_cache=1024, nheads=nheads,
                  nheads_k=nheads_k, head_dim=head_dim, dtype=torch.bfloat16, paged=paged,
                  page_block_size=page_block_size, batch_idx=False, leftpad=False, rotary=None,
                  rotary_fraction=1.0, mask="none", softcap=0.0, alibi=False, num_splits=0,
                  lengths_seed=11))


@gpu
def test_lse_matches_reference():
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    k_cache = torch.randn(2, 50, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.tensor([50, 17], device=DEVICE, dtype=torch.int32)
    for num_splits in (1, 3):
        _, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                         num_splits=num_splits, return_softmax_lse=True)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k_cache.float()) / 8.0
        scores = scores.masked_fill(torch.arange(50, device=DEVICE)[None, None, None]
                                    >= seqlens[:, None, None, None], float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=2e-3)


def decode_inputs(batch, seqlen_cache, nheads, nheads_k, head_dim, dtype):
    """q of one token, a random (batch, seqlen_cache) cache and one new key/value per row."""
    torch.manual_seed(0)
    q = torch.randn(batch, 1, nheads, head_dim, device=DEVICE, dtype=dtype)
    k_cache = torch.randn(batch, seqlen_cache, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, 1, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    return q, k_cache, torch.randn_like(k_cache), k, torch.randn_like(k)


@gpu
def test_int_cache_seqlens_and_empty_cache():
    q, k_cache, v_cache, k, v = decode_inputs(2, 32, 4, 4, 64, torch.float16)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=0)
    # One key each: the output is its value.
    torch.testing.assert_close(out, v, rtol=0, atol=1e-3)
    torch.testing.assert_close(k_cache[:, 0:1], k, rtol=0, atol=0)
    # No keys at all: zeros and lse +inf, as flash_attn_func gives fully masked rows.
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=0,
                                       return_softmax_lse=True)
    assert out.eq(0).all() and lse.isinf().all() and (lse > 0).all()


@gpu
def test_under_cuda_graph_and_compile():
    """Decoding's way of calling it: captured once, replayed with new lengths; and compiled."""
    q, k_cache, v_cache, k, v = decode_inputs(4, 256, 8, 2, 128, torch.bfloat16)
    seqlens = torch.tensor([3, 100, 0, 200], device=DEVICE, dtype=torch.int32)
    expected = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                       cache_seqlens=seqlens.clone(), causal=True)
    graph = torch.cuda.CUDAGraph()
    static = seqlens.clone()
    kc, vc = k_cache.clone(), v_cache.clone()
    flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=static, causal=True)
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=static, causal=True)
    graph.replay()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    compiled = torch.compile(flash_attn_with_kvcache, fullgraph=True)
    torch.testing.assert_close(
        compiled(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=seqlens.clone(),
                 causal=True), expected, rtol=0, atol=0)


# --- bad input: checked in Python before any CUDA work, so these run on CPU too ---------------

def _cpu_case(**kw):
    q = torch.randn(2, 1, 4, 64).half()
    k_cache = torch.randn(2, 32, 2, 64).half()
    args = dict(q=q, k_cache=k_cache, v_cache=torch.randn_like(k_cache))
    args.update(kw)
    return args


@pytest.mark.parametrize("kwargs,match", [
    (dict(q=torch.randn(2, 1, 4, 60).half(), k_cache=torch.randn(2, 32, 2, 60).half(),
          v_cache=torch.randn(2, 32, 2, 60).half()), "head dim that is a multiple of 8"),
    (dict(k=torch.randn(2, 1, 2, 64).half()), "k and v must be given together"),
    (dict(k=torch.randn(2, 1, 3, 64).half(), v=torch.randn(2, 1, 3, 64).half()),
     r"k must be \(batch, seqlen_new, nheads_k, headdim\)"),
    (dict(cache_seqlens=40), r"cache_seqlens must be in \[0, 32\]"),
    (dict(cache_seqlens=torch.tensor([1, 2])), "cache_seqlens must be an int32 tensor"),
    (dict(rotary_cos=torch.randn(32, 16), rotary_sin=torch.randn(32, 16)),
     "rotary_cos must be given with the new k and v"),
    (dict(k=torch.randn(2, 1, 2, 64).half(), v=torch.randn(2, 1, 2, 64).half(),
          rotary_cos=torch.randn(8, 16), rotary_sin=torch.randn(8, 16)),
     "rotary_cos must be at least the cache's 32 positions long"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int32), k_cache=torch.randn(4, 24, 2, 64).half(),
          v_cache=torch.randn(4, 24, 2, 64).half()), "page_block_size that is a multiple of 16"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int32),
          cache_batch_idx=torch.zeros(2, dtype=torch.int32)), "cache_batch_idx must be None"),
    (dict(num_splits=-1), "num_splits must be an int >= 0"),
    (dict(window_size=(-3, 0)), "window_size must be a pair"),
    (dict(k_cache=torch.randn(1, 32, 2, 64).half(), v_cache=torch.randn(1, 32, 2, 64).half()),
     "k_cache must be at least q's 2 batch rows"),
    (dict(), "q must be on a CUDA device"),
])
def test_bad_input_names_the_argument(kwargs, match):
    if torch.cuda.is_available() and "CUDA device" in match:
        pytest.skip("CPU tensors are the bad input here")
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(**_cpu_case(**kwargs))


def test_host_checks_of_lengths(monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_CHECK_INPUTS", "1")
    k = torch.randn(2, 2, 2, 64).half()
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 30\]"):
        flash_attn_with_kvcache(**_cpu_case(k=k, v=k.clone(),
                                            cache_seqlens=torch.tensor([31, 0], dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"cache_leftpad must be in \[0, cache_seqlens\]"):
        flash_attn_with_kvcache(**_cpu_case(cache_seqlens=torch.tensor([3, 0], dtype=torch.int32),
                                            cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)))
