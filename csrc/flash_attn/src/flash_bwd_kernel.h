// The attention backward (mma.sync, or wgmma on sm90 where the tile allows: wgmma.h), in three
// kernels:
//   1. softmax_d = rowsum(dO * O) per query row, dq_accum zeroed (flash_bwd_dot_do_o_kernel);
//   2. per key block: recompute P from Q, K and the forward's log-sum-exp, then
//      dV += P^T dO, dP = dO V^T, dS = P (dP - softmax_d), dK += dS^T Q, dQ += dS K (dQ added in
//      fp32 to dq_accum) (flash_bwd_kernel);
//   3. dq = softmax_scale * (sum of the dq_accum splits), in the input dtype
//      (flash_bwd_convert_dq_kernel).
// Nothing of size seqlen_q x seqlen_k is stored: P is rebuilt tile by tile.
#pragma once

#include <cute/tensor.hpp>

#include "block_range.h"
#include "bwd_epilogue.h"
#include "dropout.h"
#include "flash.h"
#include "kernel_traits.h"
#include "score_mods.h"
#include "sequence_info.h"
#include "softmax.h"
#include "utils.h"
#include "wgmma.h"

namespace flash {

using namespace cute;

// Where one (token, head) of a query-side tensor and its dq_accum row are: the pre- and
// post-processing kernels walk tokens of the packed (varlen) or padded layout alike.
struct TokenRow {
    int64_t acc_row;  // row of dq_accum
    int64_t lse_idx;  // index into softmax_lse / softmax_d
    int64_t b, row;   // batch entry and row in it (padded layout), or 0 and the token (varlen)

    __device__ TokenRow(const AttentionParams &params, int token, int head) {
        if (params.cu_seqlens_q != nullptr) {  // varlen: token is the row in the packed q
            b = 0, row = token, acc_row = token;
            lse_idx = int64_t(head) * params.total_q + token;
        } else {
            b = token / params.seqlen_q, row = token % params.seqlen_q;
            acc_row = b * params.seqlen_q_rounded + row;
            lse_idx = (b * params.heads + head) * params.seqlen_q + row;
        }
    }
    __device__ int64_t offset(int64_t batch_stride, int64_t row_stride, int64_t head_stride, int head) const {
        return b * batch_stride + row * row_stride + int64_t(head) * head_stride;
    }
};

// A 16-byte chunk of 8 elements, or fewer bytes where the address is not 16-byte aligned (any
// strides are accepted).
template <typename Element>
__device__ __forceinline__ void load_chunk(const Element *src, float (&dst)[8]) {
    if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
        const uint4 raw = *reinterpret_cast<const uint4 *>(src);
        const Element *e = reinterpret_cast<const Element *>(&raw);
        CUTE_UNROLL
        for (int i = 0; i < 8; ++i) { dst[i] = float(e[i]); }
    } else {
        CUTE_UNROLL
        for (int i = 0; i < 8; ++i) { dst[i] = float(src[i]); }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. softmax_d = rowsum(dO * O), and the token's dq_accum rows (every split) zeroed, so that no
//    separate pass clears dq_accum: eight lanes per (token, head), 16-byte loads.
// ---------------------------------------------------------------------------------------------

constexpr int kDotLanesPerRow = 8;

template <typename Element>
__global__ void flash_bwd_dot_do_o_kernel(const __grid_constant__ AttentionParams params, int num_tokens) {
    const int64_t id = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kDotLanesPerRow;
    const int lane = threadIdx.x % kDotLanesPerRow;
    // No early return: the whole warp takes part in the shuffles below.
    const bool valid = id < int64_t(num_tokens) * params.heads;
    const int token = valid ? int(id / params.heads) : 0, head = valid ? int(id % params.heads) : 0;
    const TokenRow tr(params, token, head);
    float sum = 0.f;
    if (valid) {
        const Element *o = reinterpret_cast<const Element *>(params.o_ptr) +
                           tr.offset(params.o_batch_stride, params.o_row_stride, params.o_head_stride, head);
        const Element *dout = reinterpret_cast<const Element *>(params.do_ptr) +
                              tr.offset(params.do_batch_stride, params.do_row_stride, params.do_head_stride, head);
        for (int c = lane * 8; c < params.head_dim; c += kDotLanesPerRow * 8) {
            float o_chunk[8], do_chunk[8];
            load_chunk(o + c, o_chunk);
            load_chunk(dout + c, do_chunk);
            CUTE_UNROLL
            for (int i = 0; i < 8; ++i) { sum += o_chunk[i] * do_chunk[i]; }
        }
        const int kernel_head_dim = int(params.dq_accum_row_stride);
        float4 *acc = reinterpret_cast<float4 *>(params.dq_accum_ptr + int64_t(head) * params.dq_accum_head_stride +
                                                 tr.acc_row * kernel_head_dim);
        for (int split = 0; split < params.num_splits; ++split) {
            for (int c = lane; c < kernel_head_dim / 4; c += kDotLanesPerRow) {
                acc[split * params.dq_accum_split_stride / 4 + c] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    }
    CUTE_UNROLL
    for (int offset = kDotLanesPerRow / 2; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffff, sum, offset);
    }
    if (valid && lane == 0) { params.softmax_d_ptr[tr.lse_idx] = sum; }
}

// ---------------------------------------------------------------------------------------------
// 3. dq = softmax_scale * sum over splits of dq_accum, converted and written with dq's strides:
//    one thread per 8 columns.
// ---------------------------------------------------------------------------------------------

template <typename Element>
__global__ void flash_bwd_convert_dq_kernel(const __grid_constant__ AttentionParams params, int num_tokens) {
    const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int chunks = params.head_dim / 8;
    const int64_t per_token = int64_t(params.heads) * chunks;
    if (idx >= int64_t(num_tokens) * per_token) { return; }
    const int token = int(idx / per_token);
    const int head = int(idx % per_token) / chunks, col = int(idx % chunks) * 8;
    const TokenRow tr(params, token, head);
    const int kernel_head_dim = int(params.dq_accum_row_stride);
    const float *acc = params.dq_accum_ptr + int64_t(head) * params.dq_accum_head_stride +
                       tr.acc_row * kernel_head_dim;
    const int col_lo = dq_accum_col(tr.acc_row, col), col_hi = dq_accum_col(tr.acc_row, col + 4);
    float sum[8] = {};
    for (int split = 0; split < params.num_splits; ++split) {  // fixed order: deterministic
        const float *row = acc + split * params.dq_accum_split_stride;
        const float4 lo = *reinterpret_cast<const float4 *>(row + col_lo);
        const float4 hi = *reinterpret_cast<const float4 *>(row + col_hi);
        sum[0] += lo.x, sum[1] += lo.y, sum[2] += lo.z, sum[3] += lo.w;
        sum[4] += hi.x, sum[5] += hi.y, sum[6] += hi.z, sum[7] += hi.w;
    }
    Element *dq = reinterpret_cast<Element *>(params.dq_ptr) +
                  tr.offset(params.dq_batch_stride, params.dq_row_stride, params.dq_head_stride, head) + col;
    Element out[8];
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) { out[i] = Element(sum[i] * params.softmax_scale); }
    if ((reinterpret_cast<uintptr_t>(dq) & 15) == 0) {
        *reinterpret_cast<uint4 *>(dq) = *reinterpret_cast<const uint4 *>(out);
    } else {
        CUTE_UNROLL
        for (int i = 0; i < 8; ++i) { dq[i] = out[i]; }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. dK, dV (and dQ through dq_accum) of one key block.
// ---------------------------------------------------------------------------------------------

// Shared memory of the sm90 path's dQ tile (after the row statistics below): the backward kernel
// and its launch agree on this through kBackwardWgmmaApplies (not BackwardWgmma::kEnabled, which
// the host pass sees false).
template <typename Traits>
constexpr int kSmemDqSize = kBackwardWgmmaApplies<Traits> ? Traits::kBlockM * Traits::kHeadDim * int(sizeof(float)) : 0;

// The forward's log-sum-exp and softmax_d of a query block's rows ride along with its Q and dO
// tiles (4-byte asynchronous copies, double-buffered after the tiles), so that they are read from
// shared memory after the S and dP GEMMs instead of occupying registers across them.
template <typename Traits>
constexpr int kSmemRowStatsSize = 2 * 2 * Traits::kBlockM * int(sizeof(float));  // (lse, d) x 2 buffers

template <typename Traits, bool Is_dropout, bool Is_masked>
__device__ void bwd_key_block(const AttentionParams &params, const SequenceInfo &seq, int n_block, int bidb,
                              int bidh, int dq_accum_split, char *smem) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    const int tidx = threadIdx.x, lane = tidx % 32;
    const bool even_k = params.head_dim == kHeadDim;
    const int kv_rows = seq.seqlen_k - n_block * kBlockN;

    // Query blocks that see any key of this block.
    const auto m_range = QueryBlockRange<kBlockM, kBlockN, Is_masked>::make(params, seq, n_block);
    const int m_block_min = m_range.m_block_min, m_block_max = m_range.m_block_max;

    const int bidh_k = bidh / params.heads_per_head_k;
    const int64_t k_row0 = seq.k_offset(params.k_batch_stride, params.k_row_stride) +
                           int64_t(n_block) * kBlockN * params.k_row_stride + int64_t(bidh_k) * params.k_head_stride;
    const int64_t v_row0 = seq.k_offset(params.v_batch_stride, params.v_row_stride) +
                           int64_t(n_block) * kBlockN * params.v_row_stride + int64_t(bidh_k) * params.v_head_stride;
    const int64_t dk_row0 = seq.k_offset(params.dk_batch_stride, params.dk_row_stride) +
                            int64_t(n_block) * kBlockN * params.dk_row_stride + int64_t(bidh) * params.dk_head_stride;
    const int64_t dv_row0 = seq.k_offset(params.dv_batch_stride, params.dv_row_stride) +
                            int64_t(n_block) * kBlockN * params.dv_row_stride + int64_t(bidh) * params.dv_head_stride;

    typename Traits::TiledMmaSdP tiled_mma_sdp_sync;
    typename Traits::TiledMmadKV tiled_mma_dkv_sync;
    typename Traits::TiledMmadQ tiled_mma_dq_sync;
    // The five products run on wgmma where it applies (wgmma.h), else on mma.sync; their
    // accumulators are laid out by the MMA that computes them.
    using Wgmma = BackwardWgmma<Traits>;
    constexpr bool kWgmma = Wgmma::kEnabled;
    typename Wgmma::TiledMmaSdP tiled_mma_sdp;
    typename Wgmma::TiledMmadKV tiled_mma_dkv;
    typename Wgmma::TiledMmadQ tiled_mma_dq;
    const int wg_thread0 = kWgmma ? warpgroup_first_thread(tidx) : 0;  // slices the shared-memory operands
    auto thr_mma_sdp = tiled_mma_sdp_sync.get_thread_slice(tidx);
    auto thr_mma_dkv = tiled_mma_dkv_sync.get_thread_slice(tidx);
    auto thr_mma_dq = tiled_mma_dq_sync.get_thread_slice(tidx);
    Tensor acc_dk = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor acc_dv = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    clear(acc_dk);
    clear(acc_dv);

    if (m_block_max <= m_block_min) {  // no query sees these keys: their gradients are 0
        store_dkv<Element, kBlockN, kHeadDim>(acc_dk, tiled_mma_dkv, threadIdx.x, params.dk_ptr, dk_row0,
                                              params.dk_row_stride, kv_rows, params.head_dim, 0.f);
        store_dkv<Element, kBlockN, kHeadDim>(acc_dv, tiled_mma_dkv, threadIdx.x, params.dv_ptr, dv_row0,
                                              params.dv_row_stride, kv_rows, params.head_dim, 0.f);
        return;
    }

    // Shared memory: Q[2], dO[2], K, V, P, dS.
    Element *smem_q = reinterpret_cast<Element *>(smem);
    Element *smem_do = smem_q + 2 * size(typename Traits::SmemLayoutQdO{});
    Element *smem_k = smem_do + 2 * size(typename Traits::SmemLayoutQdO{});
    Element *smem_v = smem_k + size(typename Traits::SmemLayoutKV{});
    Element *smem_p = smem_v + size(typename Traits::SmemLayoutKV{});
    Element *smem_ds = smem_p + size(typename Traits::SmemLayoutPdS{});
    float *smem_row_stats = reinterpret_cast<float *>(smem + Traits::kSmemSize);  // [buf][lse, d][row]
    float *smem_dq = smem_row_stats + kSmemRowStatsSize<Traits> / int(sizeof(float));  // sm90 path's dQ tile
    // Buffer `buf` of the double-buffered Q or dO, in the given layout (rows x d, or transposed).
    auto buffer = [&](Element *base, int buf, auto layout) {
        return make_tensor(make_smem_ptr(base + buf * size(typename Traits::SmemLayoutQdO{})), layout);
    };
    auto sQ = [&](int buf) { return buffer(smem_q, buf, typename Traits::SmemLayoutQdO{}); };
    auto sdO = [&](int buf) { return buffer(smem_do, buf, typename Traits::SmemLayoutQdO{}); };
    auto sQt = [&](int buf) { return buffer(smem_q, buf, typename Traits::SmemLayoutQdOt{}); };
    auto sdOt = [&](int buf) { return buffer(smem_do, buf, typename Traits::SmemLayoutQdOt{}); };
    Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
    Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
    Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPdS{});
    Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPdSt{});
    Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPdSt{});

    // Global -> shared copies (predicated on the sequence ends and the head dim).
    typename Traits::GmemTiledCopyQKV gmem_tiled_copy;
    auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
    Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    Tensor tQpQ = col_predicates(tQcQ, params.head_dim);
    Tensor tKVpKV = col_predicates(tKVcKV, params.head_dim);

    auto gmem_tile = [&](const void *ptr, int64_t offset, int64_t row_stride, auto rows) {
        return make_tensor(make_gmem_ptr(reinterpret_cast<const Element *>(ptr) + offset),
                           Shape<decltype(rows), Int<kHeadDim>>{}, make_stride(row_stride, _1{}));
    };
    {
        Tensor gK = gmem_tile(params.k_ptr, k_row0, params.k_row_stride, Int<kBlockN>{});
        Tensor gV = gmem_tile(params.v_ptr, v_row0, params.v_row_stride, Int<kBlockN>{});
        Tensor tKgK = gmem_thr_copy.partition_S(gK);
        Tensor tKsK = gmem_thr_copy.partition_D(sK);
        Tensor tVgV = gmem_thr_copy.partition_S(gV);
        Tensor tVsV = gmem_thr_copy.partition_D(sV);
        copy_tile(gmem_tiled_copy, tKgK, tKsK, tKVcKV, tKVpKV, kv_rows, even_k && kv_rows >= kBlockN);
        copy_tile(gmem_tiled_copy, tVgV, tVsV, tKVcKV, tKVpKV, kv_rows, even_k && kv_rows >= kBlockN);
    }
    const int64_t q_base = seq.q_offset(params.q_batch_stride, params.q_row_stride, bidb) +
                           int64_t(bidh) * params.q_head_stride;
    const int64_t do_base = seq.q_offset(params.do_batch_stride, params.do_row_stride, bidb) +
                            int64_t(bidh) * params.do_head_stride;
    auto load_q_do = [&](int m_block, int buf) {
        const int rows = seq.seqlen_q - m_block * kBlockM;
        const bool full = even_k && rows >= kBlockM;
        Tensor gQ = gmem_tile(params.q_ptr, q_base + int64_t(m_block) * kBlockM * params.q_row_stride,
                              params.q_row_stride, Int<kBlockM>{});
        Tensor gdO = gmem_tile(params.do_ptr, do_base + int64_t(m_block) * kBlockM * params.do_row_stride,
                               params.do_row_stride, Int<kBlockM>{});
        Tensor sQb = sQ(buf);
        Tensor sdOb = sdO(buf);
        Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
        Tensor tQsQ = gmem_thr_copy.partition_D(sQb);
        Tensor tdOgdO = gmem_thr_copy.partition_S(gdO);
        Tensor tdOsdO = gmem_thr_copy.partition_D(sdOb);
        copy_tile(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, tQpQ, rows, full);
        copy_tile(gmem_tiled_copy, tdOgdO, tdOsdO, tQcQ, tQpQ, rows, full);
        // Rows past the sequence are not copied: they are read as lse = +inf below (P = 0).
        for (int i = tidx; i < 2 * kBlockM; i += Traits::kNThreads) {
            const int row = i % kBlockM;
            if (row < rows) {
                const int64_t idx = lse_index(params, seq, bidb, bidh, m_block * kBlockM + row);
                SM80_CP_ASYNC_CACHEALWAYS<float>::copy(
                    (i < kBlockM ? params.softmax_lse_ptr : params.softmax_d_ptr)[idx],
                    smem_row_stats[(buf * 2 + i / kBlockM) * kBlockM + row]);
            }
        }
    };
    load_q_do(m_block_min, 0);
    cute::cp_async_fence();

    // Shared -> register copies of the five GEMMs.
    auto smem_copy_A_sdp = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma_sdp_sync);
    auto smem_copy_B_sdp = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma_sdp_sync);
    auto smem_copy_At_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dkv_sync);
    auto smem_copy_Bt_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dkv_sync);
    auto smem_copy_A_dq = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma_dq_sync);
    auto smem_copy_Bt_dq = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dq_sync);
    auto thr_copy_A_sdp = smem_copy_A_sdp.get_thread_slice(tidx);
    auto thr_copy_B_sdp = smem_copy_B_sdp.get_thread_slice(tidx);
    auto thr_copy_At_dkv = smem_copy_At_dkv.get_thread_slice(tidx);
    auto thr_copy_Bt_dkv = smem_copy_Bt_dkv.get_thread_slice(tidx);
    auto thr_copy_A_dq = smem_copy_A_dq.get_thread_slice(tidx);
    auto thr_copy_Bt_dq = smem_copy_Bt_dq.get_thread_slice(tidx);

    // Register operands (fragments laid out without the swizzle).
    Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ(0));
    Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);
    Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO(0));
    Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);
    Tensor tdVrPt = thr_mma_dkv.partition_fragment_A(
        make_tensor(smem_p, typename Traits::SmemLayoutPdStNoSwizzle{}));
    Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(
        make_tensor(smem_do, typename Traits::SmemLayoutQdOtNoSwizzle{}));
    Tensor tdKrdSt = thr_mma_dkv.partition_fragment_A(
        make_tensor(smem_ds, typename Traits::SmemLayoutPdStNoSwizzle{}));
    Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(
        make_tensor(smem_q, typename Traits::SmemLayoutQdOtNoSwizzle{}));
    Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);
    Tensor tdQrKt = thr_mma_dq.partition_fragment_B(make_tensor(smem_k, typename Traits::SmemLayoutKtNoSwizzle{}));

    Tensor tSsK = thr_copy_B_sdp.partition_S(sK);
    Tensor tdPsV = thr_copy_B_sdp.partition_S(sV);
    Tensor tdVsPt = thr_copy_At_dkv.partition_S(sPt);
    Tensor tdKsdSt = thr_copy_At_dkv.partition_S(sdSt);
    Tensor tdQsdS = thr_copy_A_dq.partition_S(sdS);
    Tensor tdQsKt = thr_copy_Bt_dq.partition_S(sKt);

    // Registers -> shared memory for P and dS (and, with softcap, the tanh derivative).
    auto smem_copy_PdS = make_tiled_copy_C(typename Traits::SmemCopyAtomAcc{}, tiled_mma_sdp);
    auto thr_copy_PdS = smem_copy_PdS.get_thread_slice(tidx);
    Tensor tPsP = thr_copy_PdS.partition_D(sP);
    Tensor tdSsdS = thr_copy_PdS.partition_D(sdS);

    // (row, col) inside the tile of each S element this thread holds.
    Tensor tScS = tiled_mma_sdp.get_thread_slice(tidx).partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor tScS_rc = make_tensor(tScS.data(), acc_as_rowcol(tScS.layout()));
    constexpr int kRows = decltype(size<0>(tScS_rc))::value;

    // dq_accum rows of this (split, head, sequence); rows past the sequence only ever receive exact
    // zeros (P is 0 there).
    const int64_t dq_row0 = seq.q_start >= 0 ? seq.q_start : int64_t(bidb) * params.seqlen_q_rounded;
    float *dq_accum = params.dq_accum_ptr + dq_accum_split * params.dq_accum_split_stride +
                      int64_t(bidh) * params.dq_accum_head_stride + dq_row0 * kHeadDim;

    const ScoreMods score_mods = ScoreMods::make(params, seq, bidb, bidh);
    const bool has_softcap = score_mods.has_softcap;
    uint64_t seed = 0, offset = 0;
    if constexpr (Is_dropout) { philox_seed_offset(params.philox, seed, offset); }
    const Dropout dropout(params, seed, offset, bidb, bidh);
    constexpr float kLog2e = 1.4426950408889634f;

    for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
        const int buf = (m_block - m_block_min) % 2;
        cute::cp_async_wait<0>();
        if constexpr (kWgmma) { fence_smem_for_wgmma(); }
        __syncthreads();  // Q/dO[m] (and K, V) landed; every warp is done with the last iteration's tiles
        if (m_block + 1 < m_block_max) {
            load_q_do(m_block + 1, buf ^ 1);
            cute::cp_async_fence();
        }

        // S = Q K^T and dP = dO V^T, both issued before any element-wise work so that the exp and
        // mask instructions below overlap with the tensor cores still working on dP.
        Tensor acc_s = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        Tensor acc_dp = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        if constexpr (kWgmma) {
            const int buf_offset = buf * size(typename Traits::SmemLayoutQdO{});
            auto wg_sdp = tiled_mma_sdp.get_thread_slice(wg_thread0);
            auto sB = [&](Element *ptr) {
                return wg_sdp.partition_fragment_B(smem_view(ptr, typename Wgmma::SmemLayoutKV{}));
            };
            auto sA = [&](Element *ptr) {
                return wg_sdp.partition_fragment_A(smem_view(ptr + buf_offset, typename Wgmma::SmemLayoutQdO{}));
            };
            wgmma_gemm<true>(tiled_mma_sdp, sA(smem_q), sB(smem_k), acc_s);
            wgmma_gemm<true>(tiled_mma_sdp, sA(smem_do), sB(smem_v), acc_dp);
            warpgroup_wait<1>();  // S is done; dP runs on beside the exp below
            warpgroup_fence_operand(acc_s);
        } else {
            // With a 128 x 128 tile, S and dP alone fill half the registers: their operands are
            // then not prefetched a k-slice ahead, which keeps the loop from spilling.
            constexpr bool kPrefetchSdP = kBlockM * kBlockN < 128 * 128;
            clear(acc_s);
            gemm<false, kPrefetchSdP>(acc_s, tSrQ, tSrK, thr_copy_A_sdp.partition_S(sQ(buf)), tSsK, tiled_mma_sdp_sync,
                                      smem_copy_A_sdp, smem_copy_B_sdp, thr_copy_A_sdp, thr_copy_B_sdp);
            clear(acc_dp);
            gemm<false, kPrefetchSdP>(acc_dp, tdPrdO, tdPrV, thr_copy_A_sdp.partition_S(sdO(buf)), tdPsV,
                                      tiled_mma_sdp_sync, smem_copy_A_sdp, smem_copy_B_sdp, thr_copy_A_sdp,
                                      thr_copy_B_sdp);
        }

        // This thread's rows: log-sum-exp of the forward (+inf past the sequence: P = 0 there)
        // and softmax_d.
        float lse_log2[kRows], row_d[kRows];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const int row = get<0>(tScS_rc(r, 0));
            const bool valid = m_block * kBlockM + row < seq.seqlen_q;
            lse_log2[r] = valid ? smem_row_stats[(buf * 2) * kBlockM + row] * kLog2e : INFINITY;
            row_d[r] = valid ? smem_row_stats[(buf * 2 + 1) * kBlockM + row] : 0.f;
        }

        // The forward's score modifications, then P = exp(S - lse).
        Tensor scores = make_tensor(acc_s.data(), acc_as_rowcol(acc_s.layout()));
        score_mods.apply<kBlockM, kBlockN, Is_masked>(acc_s, scores, tScS_rc, m_block, n_block, [&] {
            // Stage the softcap's derivative in dS's shared memory until dS is computed.
            Tensor rdtanh = ScoreMods::tanh_derivative<Element>(acc_s);
            cute::copy(smem_copy_PdS, thr_copy_PdS.retile_S(rdtanh), tdSsdS);
        });
        CUTE_UNROLL
        for (int r = 0; r < size<0>(scores); ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(scores); ++c) {
                scores(r, c) = exp2f(scores(r, c) * params.score_scale_log2 - lse_log2[r]);
            }
        }
        if constexpr (Is_dropout) {  // dropped elements become -P (see dS below)
            dropout.apply<true, false>(scores, tScS_rc, m_block * kBlockM, n_block * kBlockN, lane,
                                       static_cast<Element *>(nullptr), 0);
        }

        if constexpr (kWgmma) {
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_dp);
        }
        // dS = P (dP / keep_prob (0 where dropped) - softmax_d) [* (1 - tanh^2)]. Two copies of the
        // loop, so that without softcap no instruction of its derivative is issued (predicated off).
        Tensor dp = make_tensor(acc_dp.data(), acc_as_rowcol(acc_dp.layout()));
        auto compute_ds = [&](auto softcap_on) {
            constexpr bool Has_softcap = decltype(softcap_on)::value;
            Tensor dtanh_staged = make_tensor<Element>(acc_dp.layout());
            if constexpr (Has_softcap) { cute::copy(smem_copy_PdS, tdSsdS, thr_copy_PdS.retile_D(dtanh_staged)); }
            Tensor dtanh_rc = make_tensor(dtanh_staged.data(), acc_as_rowcol(dtanh_staged.layout()));
            CUTE_UNROLL
            for (int r = 0; r < size<0>(dp); ++r) {
                CUTE_UNROLL
                for (int c = 0; c < size<1>(dp); ++c) {
                    dp(r, c) = softmax_grad<Is_dropout, Has_softcap>(scores(r, c), dp(r, c), row_d[r],
                                                                     params.inv_keep_prob, float(dtanh_rc(r, c)));
                }
            }
        };
        if (has_softcap) {
            compute_ds(std::true_type{});
        } else {
            compute_ds(std::false_type{});
        }
        Tensor rP = convert_type<Element>(acc_s);
        Tensor rdS = convert_type<Element>(acc_dp);
        cute::copy(smem_copy_PdS, thr_copy_PdS.retile_S(rP), tPsP);
        cute::copy(smem_copy_PdS, thr_copy_PdS.retile_S(rdS), tdSsdS);
        if constexpr (kWgmma) {
            fence_smem_for_wgmma();
            if (tidx == 0) { bulk_wait_source_read(); }  // the last dQ tile has left its buffer
        }
        __syncthreads();  // P and dS complete in shared memory (and the dQ buffer free)

        // dV += P^T dO (the 1 / keep_prob of dropout is applied once, at the end), dK += dS^T Q,
        // dQ = dS K.
        Tensor acc_dq = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        if constexpr (kWgmma) {
            const int buf_offset = buf * size(typename Traits::SmemLayoutQdO{});
            auto wg_dkv = tiled_mma_dkv.get_thread_slice(wg_thread0);
            auto wg_dq = tiled_mma_dq.get_thread_slice(wg_thread0);
            using LayoutPdSt = typename Wgmma::SmemLayoutPdSt;
            using LayoutQdOt = typename Wgmma::SmemLayoutQdOt;
            wgmma_gemm<true>(tiled_mma_dq,
                             wg_dq.partition_fragment_A(smem_view(smem_ds, typename Wgmma::SmemLayoutdS{})),
                             wg_dq.partition_fragment_B(smem_view(smem_k, typename Wgmma::SmemLayoutKt{})), acc_dq);
            wgmma_gemm<false>(tiled_mma_dkv, wg_dkv.partition_fragment_A(smem_view(smem_p, LayoutPdSt{})),
                              wg_dkv.partition_fragment_B(smem_view(smem_do + buf_offset, LayoutQdOt{})), acc_dv);
            wgmma_gemm<false>(tiled_mma_dkv, wg_dkv.partition_fragment_A(smem_view(smem_ds, LayoutPdSt{})),
                              wg_dkv.partition_fragment_B(smem_view(smem_q + buf_offset, LayoutQdOt{})), acc_dk);
            warpgroup_wait<2>();  // dQ's batch is done: it leaves while the dV and dK products run
            warpgroup_fence_operand(acc_dq);
            stage_dq_accum<kBlockM, kHeadDim>(acc_dq, tiled_mma_dq, threadIdx.x, smem_dq,
                                              dq_row0 + int64_t(m_block) * kBlockM);
            fence_smem_for_wgmma();  // the bulk reduction reads through the async proxy
            __syncthreads();
            if (tidx == 0) {
                bulk_add_to_global(dq_accum + int64_t(m_block) * kBlockM * kHeadDim, smem_dq, kSmemDqSize<Traits>);
            }
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_dv);
            warpgroup_fence_operand(acc_dk);
        } else {
            gemm(acc_dv, tdVrPt, tdVrdOt, tdVsPt, thr_copy_Bt_dkv.partition_S(sdOt(buf)), tiled_mma_dkv_sync,
                 smem_copy_At_dkv, smem_copy_Bt_dkv, thr_copy_At_dkv, thr_copy_Bt_dkv);

            gemm(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, thr_copy_Bt_dkv.partition_S(sQt(buf)), tiled_mma_dkv_sync,
                 smem_copy_At_dkv, smem_copy_Bt_dkv, thr_copy_At_dkv, thr_copy_Bt_dkv);
            clear(acc_dq);
            gemm(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, tiled_mma_dq_sync, smem_copy_A_dq, smem_copy_Bt_dq,
                 thr_copy_A_dq, thr_copy_Bt_dq);
            add_dq_accum<Traits>(acc_dq, tiled_mma_dq, threadIdx.x, dq_accum + int64_t(m_block) * kBlockM * kHeadDim,
                                 dq_row0 + int64_t(m_block) * kBlockM);
        }
    }
    // The dQ tiles have landed before the next key block's (deterministic: the same rows, in order)
    // and before the CTA's shared memory goes.
    if constexpr (kWgmma) {
        if (tidx == 0) { bulk_wait_done(); }
    }

    const float dk_scale = params.softmax_scale, dv_scale = Is_dropout ? params.inv_keep_prob : 1.f;
    auto rows_aligned = [](const void *ptr, int64_t offset, int64_t row_stride) {
        return (reinterpret_cast<uintptr_t>(static_cast<const Element *>(ptr) + offset) % 16 == 0) &&
               row_stride % (16 / sizeof(Element)) == 0;
    };
    if (rows_aligned(params.dk_ptr, dk_row0, params.dk_row_stride) &&
        rows_aligned(params.dv_ptr, dv_row0, params.dv_row_stride)) {  // the same for every thread
        __syncthreads();  // every warp is done with K and V: their tiles take dK and dV
        store_dkv_staged<Traits>(acc_dk, tiled_mma_dkv, smem_k, params.dk_ptr, dk_row0, params.dk_row_stride,
                                 kv_rows, params.head_dim, dk_scale);
        store_dkv_staged<Traits>(acc_dv, tiled_mma_dkv, smem_v, params.dv_ptr, dv_row0, params.dv_row_stride,
                                 kv_rows, params.head_dim, dv_scale);
    } else {
        store_dkv<Element, kBlockN, kHeadDim>(acc_dk, tiled_mma_dkv, threadIdx.x, params.dk_ptr, dk_row0,
                                              params.dk_row_stride, kv_rows, params.head_dim, dk_scale);
        store_dkv<Element, kBlockN, kHeadDim>(acc_dv, tiled_mma_dkv, threadIdx.x, params.dv_ptr, dv_row0,
                                              params.dv_row_stride, kv_rows, params.head_dim, dv_scale);
    }
}

// grid: BackwardCta's (block_range.h).
template <typename Traits, bool Is_dropout, bool Is_masked>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
flash_bwd_kernel(const __grid_constant__ AttentionParams params) {
    extern __shared__ __align__(1024) char smem[];  // 1024: the swizzled tiles as wgmma reads them
    const BackwardCta cta = BackwardCta::make(params);
    const SequenceInfo seq(params, cta.bidb);
    const int n_blocks = ceil_div(seq.seqlen_k, Traits::kBlockN);
    for (int n_block = cta.split; n_block < n_blocks; n_block += cta.splits) {
        bwd_key_block<Traits, Is_dropout, Is_masked>(params, seq, n_block, cta.bidb, cta.bidh, cta.dq_split, smem);
        __syncthreads();  // the next key block reuses the shared memory
    }
}

}  // namespace flash
