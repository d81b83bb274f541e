"""Decode attention bandwidth: flash_attn_with_kvcache vs PyTorch SDPA (cuDNN and flash
backends) on one query token per sequence, measured in the same run, and a device copy.

Bandwidth = bytes of K and V read (2 * batch * seqlen_cache * nheads_k * headdim * 2) / time, L2
flushed between runs (triton's do_bench). SDPA takes q (b, h, 1, d), k/v (b, h_k, s, d) with
enable_gqa; ours the cache layout (b, s, h_k, d), contiguous or paged (shuffled blocks).
Done-when checks: ours >= 0.9x SDPA cuDNN at b16 s8k GQA 32/8, b4 s64k GQA 32/8 and b64 s2k MHA;
b1 s128k >= 80% of the copy bandwidth (split-KV); paged page 16 within 10% of contiguous.
Usage: python benchmarks/benchmark_kvcache.py [--smoke]   (--smoke: tiny shapes on CPU, SDPA's
math backend standing in for ours)
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    copy_bandwidth,
    gbps,
    note_stand_in,
    parse_args,
    report,
    save_plot,
    time_ms,
    wall_ms,
)

# (batch, seqlen_cache, nheads, nheads_k, headdim)
SHAPES = [(1, 2048, 32, 8, 128), (1, 131072, 32, 8, 128), (4, 8192, 32, 8, 128),
          (4, 65536, 32, 8, 128), (16, 8192, 32, 8, 128), (64, 2048, 32, 32, 128),
          (16, 8192, 32, 32, 128), (16, 8192, 32, 8, 64), (16, 8192, 32, 8, 256)]
PAGED_SHAPES = [(16, 8192, 32, 8, 128), (4, 65536, 32, 8, 128)]
PAGE_SIZES = (16, 64, 256)
SMOKE_SHAPES = [(2, 64, 4, 2, 32), (1, 128, 4, 4, 32)]
BAR_VS_CUDNN = 0.9
BAR_VS_COPY = 0.8
BAR_PAGED = 0.9


def kv_bytes(batch, seqlen, nheads_k, headdim, elt=2):
    return 2 * batch * seqlen * nheads_k * headdim * elt


def sdpa_peer(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])

    return run


def paged(k_cache, v_cache, page_block_size, generator):
    """The caches as pages in one shuffled order, and that block table."""
    batch, seqlen = k_cache.shape[:2]
    blocks = seqlen // page_block_size
    table = torch.randperm(batch * blocks, generator=generator).view(batch, blocks)
    pages = []
    for cache in (k_cache, v_cache):
        paged_cache = torch.empty(batch * blocks, page_block_size, *cache.shape[2:],
                                  dtype=cache.dtype, device=cache.device)
        paged_cache[table.flatten()] = cache.reshape(batch * blocks, page_block_size, *cache.shape[2:])
        pages.append(paged_cache)
    return pages[0], pages[1], table.to(device=k_cache.device, dtype=torch.int32)


def measure(shape, device, timer, smoke, page_sizes=()):
    """{method: GB/s} for one shape (and the paged variants of ours)."""
    batch, seqlen, nheads, nheads_k, headdim = shape
    dtype = torch.bfloat16
    q = torch.randn(batch, 1, nheads, headdim, device=device, dtype=dtype)
    k_cache = torch.randn(batch, seqlen, nheads_k, headdim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    nbytes = kv_bytes(batch, seqlen, nheads_k, headdim)
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
    results = {}
    if smoke:
        results["ours"] = gbps(nbytes, timer(lambda: F.scaled_dot_product_attention(
            qt, kt, vt, enable_gqa=nheads != nheads_k)))
    else:
        from flash_attn import flash_attn_with_kvcache
        from torch.nn.attention import SDPBackend

        ours = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlen)
        ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(),
                                             enable_gqa=nheads != nheads_k).transpose(1, 2)
        torch.testing.assert_close(ours.float(), ref, rtol=2e-2, atol=2e-2)  # fast and right
        results["ours"] = gbps(nbytes, timer(lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlen)))
        generator = torch.Generator().manual_seed(0)
        for page in page_sizes:
            k_pages, v_pages, table = paged(k_cache, v_cache, page, generator)
            out = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlen,
                                          block_table=table)
            torch.testing.assert_close(out, ours, rtol=0, atol=1e-2)
            results[f"ours paged {page}"] = gbps(nbytes, timer(lambda: flash_attn_with_kvcache(
                q, k_pages, v_pages, cache_seqlens=seqlen, block_table=table)))
            del k_pages, v_pages
        for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                              ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
            run = sdpa_peer(backend)
            try:
                run(qt, kt, vt)
                results[name] = gbps(nbytes, timer(lambda: run(qt, kt, vt)))
            except RuntimeError as error:  # a backend that does not take this shape
                print(f"{name} unavailable for {shape}: {str(error).splitlines()[0][:100]}")
                results[name] = float("nan")
    results["copy"] = copy_bandwidth(k_cache, timer)
    return results


def main():
    args = parse_args(__doc__)
    if args.smoke:
        note_stand_in("'ours' is SDPA's math backend on CPU (flash_attn_with_kvcache needs CUDA)")
        device, timer, shapes, paged_shapes = "cpu", wall_ms, SMOKE_SHAPES, []
    else:
        device, timer, shapes, paged_shapes = "cuda", time_ms, SHAPES, PAGED_SHAPES
    torch.manual_seed(0)
    rows, all_results = [], {}
    for shape in shapes:
        print(f"measuring b={shape[0]} s={shape[1]} heads {shape[2]}/{shape[3]} d={shape[4]} ...",
              flush=True)
        result = measure(shape, device, timer, args.smoke,
                         PAGE_SIZES if shape in paged_shapes else ())
        all_results[shape] = result
        cudnn = result.get("SDPA cuDNN", float("nan"))
        for method, value in result.items():
            rows.append([f"b{shape[0]} s{shape[1]}", f"{shape[2]}/{shape[3]}", shape[4], method,
                         value / 1e3, value / cudnn if cudnn == cudnn else float("nan")])
        if device == "cuda":
            torch.cuda.empty_cache()
    report("Decode attention, K/V read bandwidth (one query per sequence, bf16)",
           ["shape", "heads q/kv", "d", "method", "TB/s", "vs SDPA cuDNN"], rows,
           notes="TB/s: bytes of K and V read / median time (L2 flushed). "
                 "Paged: shuffled blocks of that many rows.")
    series = {}
    for shape, result in all_results.items():
        if shape[4] != 128 or (shape[3] != 8 and shape[0] != 64):  # d128: GQA, and b64 MHA
            continue
        for method in ("ours", "SDPA cuDNN", "SDPA flash"):
            if method in result:
                xs, ys = series.setdefault(method, ([], []))
                xs.append(len(xs) + 1)
                ys.append(result[method] / 1e3)
    save_plot("kvcache.png", "Decode K/V bandwidth, d128 (x: shapes in table order)", "shape",
              "TB/s", series)
    if args.smoke:
        return
    checks = []
    for shape in [(16, 8192, 32, 8, 128), (4, 65536, 32, 8, 128), (64, 2048, 32, 32, 128)]:
        r = all_results[shape]
        checks.append((f"b{shape[0]} s{shape[1]} {shape[2]}/{shape[3]}: ours / cuDNN "
                       f"{r['ours'] / r['SDPA cuDNN']:.3f}", r["ours"] >= BAR_VS_CUDNN * r["SDPA cuDNN"]))
    r = all_results[(1, 131072, 32, 8, 128)]
    checks.append((f"b1 s128k: ours / copy {r['ours'] / r['copy']:.3f}", r["ours"] >= BAR_VS_COPY * r["copy"]))
    for shape in PAGED_SHAPES:
        r = all_results[shape]
        checks.append((f"b{shape[0]} s{shape[1]}: paged 16 / contiguous "
                       f"{r['ours paged 16'] / r['ours']:.3f}", r["ours paged 16"] >= BAR_PAGED * r["ours"]))
    for what, ok in checks:
        print(f"CHECK {what}: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
