"""Argument checks of the public attention functions: the one owner of the errors users see.

Every public function checks its arguments here, and its scalar options in
AttentionOptions.create (flash_attn/attention_options.py), before any kernel runs: a bad argument
raises a ValueError that names it and says what was expected. The binding (flash_api.cpp) keeps
only what a direct caller of the extension needs for memory safety.

Set FLASH_ATTN_CHECK_INPUTS=1 to also validate the contents of the index tensors on the host
(cu_seqlens_q/k against the token counts and max_seqlen_q/k, block_table's blocks, the KV cache's
lengths). It costs a device sync per call, so it is off by default; without it inconsistent
offsets are not detected.
"""

import os

import torch

MAX_HEAD_DIM = 256
# Paged K/V (block_table): pages of any multiple of 16 rows.
PAGE_BLOCK_MULTIPLE = 16


def _fail(name, expected, got):
    raise ValueError(f"flash_attn: {name} must be {expected}, got {got}")


def _check_attention_args(q, k, v, *, varlen, cu_seqlens_q=None, cu_seqlens_k=None,
                          max_seqlen_q=0, max_seqlen_k=0, alibi_slopes=None, block_table=None,
                          names=("q", "k", "v"), kv_batch_like_q=True, check_devices=True):
    """The tensor arguments of the public functions (ValueError naming the argument, as the
    caller calls q, k, v: `names`). kv_batch_like_q=False: k/v may have more batch rows (a KV
    cache)."""
    q_name, k_name, v_name = names
    for name, t in ((q_name, q), (k_name, k), (v_name, v)):
        if not isinstance(t, torch.Tensor):
            _fail(name, "a torch.Tensor", type(t).__name__)
        if t.dtype not in (torch.float16, torch.bfloat16):
            _fail(name, "float16 or bfloat16", t.dtype)
    for name, t in ((k_name, k), (v_name, v)):
        if t.dtype != q.dtype:
            _fail(name, f"the same dtype as q ({q.dtype})", t.dtype)
    rank = 3 if varlen else 4
    layout = "(total, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    if block_table is not None:
        rank_k, layout_k = 4, "(num_blocks, page_block_size, heads_k, head_dim)"
    else:
        rank_k, layout_k = rank, layout
    if q.dim() != rank:
        _fail(q_name, f"{rank}-D {layout}", f"shape {tuple(q.shape)}")
    for name, t in ((k_name, k), (v_name, v)):
        if t.dim() != rank_k:
            _fail(name, f"{rank_k}-D {layout_k}", f"shape {tuple(t.shape)}")
    head_dim, num_heads = q.shape[-1], q.shape[-2]
    if head_dim > MAX_HEAD_DIM:
        _fail(q_name, f"of head dim at most {MAX_HEAD_DIM}", f"head dim {head_dim}")
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        _fail(f"{k_name} and {v_name}", f"of the same head dim as {q_name} ({head_dim})",
              f"{k.shape[-1]} and {v.shape[-1]}")
    if k.shape != v.shape:
        _fail(v_name, f"the same shape as {k_name} {tuple(k.shape)}", f"{tuple(v.shape)}")
    num_heads_k = k.shape[-2]
    if num_heads % num_heads_k != 0:
        _fail(k_name, f"a number of heads dividing the {num_heads} query heads", num_heads_k)
    if (not varlen and block_table is None and kv_batch_like_q and k.shape[0] != q.shape[0]):
        _fail(k_name, f"of batch size {q.shape[0]} like {q_name}", k.shape[0])
    for name, t in ((q_name, q), (k_name, k), (v_name, v)):
        if t.stride(-1) != 1:
            _fail(name, "contiguous in its last dimension", f"stride {t.stride()}")
    if varlen:
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
                _fail(name, "a 1-D torch.int32 tensor of batch+1 offsets",
                      getattr(t, "dtype", type(t).__name__))
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            _fail("cu_seqlens_k", f"of length {cu_seqlens_q.numel()} like cu_seqlens_q",
                  cu_seqlens_k.numel())
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(value, bool) or int(value) != value or value < 0:
                _fail(name, "an int >= 0", value)
    if block_table is not None:
        if block_table.dtype != torch.int32 or block_table.dim() != 2:
            _fail("block_table", "a 2-D torch.int32 tensor (batch, max_blocks_per_seq)",
                  f"{block_table.dtype} of shape {tuple(block_table.shape)}")
        if k.shape[1] == 0 or k.shape[1] % PAGE_BLOCK_MULTIPLE != 0:
            _fail(k_name, f"paged with a page_block_size that is a multiple of {PAGE_BLOCK_MULTIPLE}",
                  k.shape[1])
        if not varlen and block_table.shape[0] != q.shape[0]:
            _fail("block_table", f"of {q.shape[0]} rows (one per batch entry)", block_table.shape[0])
        if cu_seqlens_k is not None and block_table.shape[0] != cu_seqlens_k.numel() - 1:
            _fail("block_table", f"of {cu_seqlens_k.numel() - 1} rows (one per sequence)",
                  block_table.shape[0])
    if alibi_slopes is not None:
        if alibi_slopes.dtype != torch.float32:
            _fail("alibi_slopes", "float32", alibi_slopes.dtype)
        if alibi_slopes.shape[-1:] != (num_heads,) or alibi_slopes.dim() not in (1, 2):
            _fail("alibi_slopes", f"of shape ({num_heads},) or (batch, {num_heads})",
                  tuple(alibi_slopes.shape))
    tensors = [(k_name, k), (v_name, v), ("cu_seqlens_q", cu_seqlens_q),
               ("cu_seqlens_k", cu_seqlens_k), ("alibi_slopes", alibi_slopes),
               ("block_table", block_table)]
    if varlen and _host_checks_enabled():
        _check_varlen_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              block_table)
    if check_devices:
        _check_devices(q, tensors, q_name)


def _check_devices(q, tensors, q_name="q"):
    """q on a CUDA device and every (name, tensor or None) of `tensors` on q's device."""
    if not q.is_cuda:
        _fail(q_name, "on a CUDA device", q.device)
    for name, t in tensors:
        if t is not None and t.device != q.device:
            _fail(name, f"on the same device as {q_name} ({q.device})", t.device)


def _host_checks_enabled():
    return os.environ.get("FLASH_ATTN_CHECK_INPUTS", "0").strip().lower() in ("1", "true", "yes", "on")


def _check_varlen_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          block_table):
    """FLASH_ATTN_CHECK_INPUTS=1: the offsets agree with the tensors (one host copy of each)."""
    paged = block_table is not None
    lengths = {}
    for name, cu, total, max_seqlen, max_name in (
            ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], max_seqlen_k,
             "max_seqlen_k")):
        offsets = cu.tolist()
        if offsets[0] != 0:
            _fail(name, "offsets starting at 0", offsets[:4])
        lengths[name] = [end - start for start, end in zip(offsets, offsets[1:])]
        if any(n < 0 for n in lengths[name]):
            _fail(name, "non-decreasing offsets", offsets)
        if total is not None and offsets[-1] > total:
            _fail(name, f"offsets within the {total} tokens of its tensor",
                  f"last offset {offsets[-1]}")
        longest = max(lengths[name], default=0)
        if longest > max_seqlen:
            _fail(max_name, f"at least the longest sequence of {name} ({longest})", max_seqlen)
    if paged:
        capacity = block_table.shape[1] * k.shape[1]
        for length in lengths["cu_seqlens_k"]:
            if length > capacity:
                _fail("cu_seqlens_k", f"sequences of at most {capacity} keys (block_table's "
                      f"{block_table.shape[1]} blocks of {k.shape[1]})", length)
        _check_used_blocks(block_table, lengths["cu_seqlens_k"], k.shape[0], k.shape[1])


def _check_used_blocks(block_table, lengths, num_blocks, page_block_size):
    """FLASH_ATTN_CHECK_INPUTS=1: the blocks each row's `lengths` keys occupy exist."""
    for row, length in zip(block_table.tolist(), lengths):
        used = row[: -(-length // page_block_size)]
        if any(not 0 <= block < num_blocks for block in used):
            _fail("block_table", f"block indices in [0, {num_blocks}) for the blocks a "
                  "sequence uses", used)


def _check_kvcache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                        cache_batch_idx, cache_leftpad, block_table, alibi_slopes, num_splits):
    """Every argument check of flash_attn_with_kvcache; returns cache_seqlens as a (batch,) int32
    tensor."""
    paged = block_table is not None
    _check_attention_args(q, k_cache, v_cache, varlen=False, alibi_slopes=alibi_slopes,
                          block_table=block_table,
                          names=("q", "k_cache", "v_cache"), kv_batch_like_q=False,
                          check_devices=False)
    batch, _, _, head_dim = q.shape
    num_heads_k = k_cache.shape[2]
    if head_dim % 8 != 0:
        _fail("q", "of a head dim that is a multiple of 8 (the cache cannot be padded in place)",
              head_dim)
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if (k is None) != (v is None):
        _fail("k and v", "given together", f"k {'None' if k is None else 'given'}, v "
              f"{'None' if v is None else 'given'}")
    if k is not None:
        shape = (batch, k.shape[1] if k.dim() == 4 else -1, num_heads_k, head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape) != shape:
                _fail(name, f"(batch, seqlen_new, nheads_k, headdim) = {shape}",
                      f"shape {tuple(getattr(t, 'shape', ()))}")
            if t.dtype != q.dtype:
                _fail(name, f"{q.dtype} like q", t.dtype)
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            _fail("rotary_cos", "given with the new k and v it rotates", "no k")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or 2 * t.shape[1] > head_dim:
                _fail(name, f"a 2-D (seqlen_ro, rotary_dim / 2) tensor, rotary_dim <= {head_dim}",
                      f"{getattr(t, 'shape', t)}")
        if rotary_cos.shape != rotary_sin.shape:
            _fail("rotary_sin", f"of rotary_cos's shape {tuple(rotary_cos.shape)}",
                  tuple(rotary_sin.shape))
        if rotary_cos.shape[0] < capacity:
            _fail("rotary_cos", f"at least the cache's {capacity} positions long",
                  rotary_cos.shape[0])
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        cache_seqlens = 0
    given_int = isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)
    if given_int and not 0 <= cache_seqlens <= capacity - new:
        _fail("cache_seqlens", f"in [0, {capacity - new}]", cache_seqlens)
    for name, t, shape in (("cache_seqlens", None if given_int else cache_seqlens, (batch,)),
                           ("cache_batch_idx", cache_batch_idx, (batch,)),
                           ("cache_leftpad", cache_leftpad, (batch,))):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32
                              or tuple(t.shape) != shape):
            _fail(name, f"an int32 tensor of shape {shape}",
                  f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if paged and cache_batch_idx is not None:
        _fail("cache_batch_idx", "None with block_table (the table maps batch entries)", "a tensor")
    if not paged and cache_batch_idx is None and k_cache.shape[0] < batch:
        _fail("k_cache", f"at least q's {batch} batch rows", k_cache.shape[0])
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        _fail("num_splits", "an int >= 0 (0: chosen automatically)", num_splits)
    if given_int:
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if _host_checks_enabled():
        lengths = cache_seqlens.tolist()
        if any(n < 0 or n + new > capacity for n in lengths):
            _fail("cache_seqlens", f"in [0, {capacity - new}] (the cache holds {capacity}, "
                  f"{new} are appended)", lengths)
        if cache_leftpad is not None and any(p < 0 or p > n for p, n in
                                             zip(cache_leftpad.tolist(), lengths)):
            _fail("cache_leftpad", "in [0, cache_seqlens]", cache_leftpad.tolist())
        if cache_batch_idx is not None and any(not 0 <= i < k_cache.shape[0]
                                               for i in cache_batch_idx.tolist()):
            _fail("cache_batch_idx", f"rows in [0, {k_cache.shape[0]})", cache_batch_idx.tolist())
        if paged:
            _check_used_blocks(block_table, [n + new for n in lengths], k_cache.shape[0],
                               k_cache.shape[1])
    _check_devices(q, [("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                       ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                       ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                       ("cache_leftpad", cache_leftpad), ("block_table", block_table),
                       ("alibi_slopes", alibi_slopes)])
    return cache_seqlens

