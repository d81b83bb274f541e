// The attention backward (sm80-class mma.sync path), in three kernels:
//   1. softmax_d = rowsum(dO * O) per query row (flash_bwd_dot_do_o_kernel);
//   2. per key block: recompute P from Q, K and the forward's log-sum-exp, then
//      dV += P^T dO, dP = dO V^T, dS = P (dP - softmax_d), dK += dS^T Q, dQ += dS K (dQ added in
//      fp32 to dq_accum) (flash_bwd_kernel);
//   3. dq = softmax_scale * (sum of the dq_accum splits), in the input dtype
//      (flash_bwd_convert_dq_kernel).
// Nothing of size seqlen_q x seqlen_k is stored: P is rebuilt tile by tile.
#pragma once

#include <cute/tensor.hpp>

#include "dropout.h"
#include "flash.h"
#include "flash_fwd_kernel.h"
#include "kernel_traits.h"
#include "mask.h"
#include "sequence_info.h"
#include "utils.h"

namespace flash {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// 1. softmax_d = rowsum(dO * O): one warp per (token, head).
// ---------------------------------------------------------------------------------------------

template <typename Element>
__global__ void flash_bwd_dot_do_o_kernel(const __grid_constant__ AttentionParams params, int num_tokens) {
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= int64_t(num_tokens) * params.heads) { return; }
    const int token = int(warp / params.heads), head = int(warp % params.heads);
    int64_t o_off, do_off, d_idx;
    if (params.cu_seqlens_q != nullptr) {  // varlen: token is the row in the packed q
        o_off = int64_t(token) * params.o_row_stride + int64_t(head) * params.o_head_stride;
        do_off = int64_t(token) * params.do_row_stride + int64_t(head) * params.do_head_stride;
        d_idx = int64_t(head) * params.total_q + token;
    } else {
        const int b = token / params.seqlen_q, row = token % params.seqlen_q;
        o_off = b * params.o_batch_stride + int64_t(row) * params.o_row_stride + int64_t(head) * params.o_head_stride;
        do_off = b * params.do_batch_stride + int64_t(row) * params.do_row_stride + int64_t(head) * params.do_head_stride;
        d_idx = (int64_t(b) * params.heads + head) * params.seqlen_q + row;
    }
    const Element *o = reinterpret_cast<const Element *>(params.o_ptr) + o_off;
    const Element *dout = reinterpret_cast<const Element *>(params.do_ptr) + do_off;
    float sum = 0.f;
    for (int i = lane; i < params.head_dim; i += 32) { sum += float(o[i]) * float(dout[i]); }
    CUTE_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, offset); }
    if (lane == 0) { params.softmax_d_ptr[d_idx] = sum; }
}

// ---------------------------------------------------------------------------------------------
// 3. dq = softmax_scale * sum over splits of dq_accum, converted and written with dq's strides.
// ---------------------------------------------------------------------------------------------

// dq_accum is (num_splits, heads, rows, kernel head dim) fp32 with rows = batch * seqlen_q_rounded
// (padded inputs) or total_q + 128 (varlen), so that a query block's rows are one contiguous range.
// Within a row, the 8-float chunks are rotated by the row index mod 8: the eight rows of an MMA
// fragment then fall in distinct banks when a dQ tile is staged in shared memory (see DqAccumWriter).
__host__ __device__ __forceinline__ int dq_accum_col(int64_t row, int col, int kernel_head_dim) {
    const int chunks = kernel_head_dim / 8;
    return ((col / 8 + int(row & 7)) % chunks) * 8 + col % 8;
}

template <typename Element>
__global__ void flash_bwd_convert_dq_kernel(const __grid_constant__ AttentionParams params, int num_tokens) {
    const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t per_token = int64_t(params.heads) * params.head_dim;
    if (idx >= int64_t(num_tokens) * per_token) { return; }
    const int token = int(idx / per_token);
    const int head = int(idx % per_token) / params.head_dim, col = int(idx % params.head_dim);
    int64_t acc_row, dq_off;
    if (params.cu_seqlens_q != nullptr) {
        acc_row = token;
        dq_off = int64_t(token) * params.dq_row_stride;
    } else {
        const int b = token / params.seqlen_q, row = token % params.seqlen_q;
        acc_row = int64_t(b) * params.seqlen_q_rounded + row;
        dq_off = b * params.dq_batch_stride + int64_t(row) * params.dq_row_stride;
    }
    const int kernel_head_dim = int(params.dq_accum_row_stride);
    const int64_t acc_off = int64_t(head) * params.dq_accum_head_stride + acc_row * kernel_head_dim +
                            dq_accum_col(acc_row, col, kernel_head_dim);
    float sum = 0.f;
    for (int split = 0; split < params.num_splits; ++split) {  // fixed order: deterministic
        sum += params.dq_accum_ptr[split * params.dq_accum_split_stride + acc_off];
    }
    reinterpret_cast<Element *>(params.dq_ptr)[dq_off + int64_t(head) * params.dq_head_stride + col] =
        Element(sum * params.softmax_scale);
}

// ---------------------------------------------------------------------------------------------
// 2. dK, dV (and dQ through dq_accum) of one key block.
// ---------------------------------------------------------------------------------------------

// Writes a dK or dV accumulator tile (tiled_mma_dkv layout), scaled, to the rows of the key
// block that exist.
template <typename Traits, typename Acc, typename TiledMma>
__device__ __forceinline__ void store_dkv(Acc const &acc, TiledMma const &tiled_mma, void *ptr, int64_t offset,
                                          int64_t row_stride, int rows_valid, int head_dim, float scale) {
    using Element = typename Traits::Element;
    constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    auto thr_mma = tiled_mma.get_thread_slice(threadIdx.x);
    Tensor g = make_tensor(make_gmem_ptr(reinterpret_cast<Element *>(ptr) + offset),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(row_stride, _1{}));
    Tensor tg = thr_mma.partition_C(g);
    Tensor tc = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
        if (get<0>(tc(i)) < rows_valid && get<1>(tc(i)) < head_dim) { tg(i) = Element(acc(i) * scale); }
    }
}

// Adds each query block's dQ (an accumulator of tiled_mma_dq) into dq_accum. On sm90, when the
// tile fits (Traits::kdQStagingFits), all threads stage it in shared memory (stage) and one thread
// hands it to the TMA unit as a single bulk reduce-add at the start of the next iteration (flush),
// so the load/store unit issues no atomics; otherwise every thread adds its elements atomically.
template <typename Traits>
struct DqAccumWriter {
    static constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
    static constexpr bool kStaged = Traits::kdQStagingFits && FLASH_ARCH_SM90;
    float *dq_accum;  // row 0 of this (split, head, sequence)
    float *smem_dq;
    int row0;         // dq_accum row index of row 0, mod 8 (it keys the chunk rotation)
    int pending = -1; // query block staged but not yet handed to the TMA unit

    template <typename Acc, typename Coords>
    __device__ __forceinline__ void add(Acc const &acc_dq, Coords const &coords, int m_block) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dq); i += 2) {  // (i, i + 1): adjacent columns of one row
            const int row = get<0>(coords(i)), col = get<1>(coords(i));
            const int offset = row * kHeadDim + dq_accum_col(row0 + row, col, kHeadDim);
            if constexpr (kStaged) {
                *reinterpret_cast<float2 *>(smem_dq + offset) = make_float2(acc_dq(i), acc_dq(i + 1));
            } else {
                atomic_add_pair(dq_accum + int64_t(m_block) * kBlockM * kHeadDim + offset, acc_dq(i), acc_dq(i + 1));
            }
        }
        if constexpr (kStaged) {
            fence_smem_for_bulk();
            pending = m_block;
        }
    }
    // After a barrier that follows add(): the staged tile goes out.
    __device__ __forceinline__ void flush() {
        if constexpr (kStaged) {
            if (pending >= 0 && threadIdx.x == 0) {
                bulk_reduce_add(dq_accum + int64_t(pending) * kBlockM * kHeadDim, smem_dq, kBlockM * kHeadDim * 4);
            }
            pending = -1;
        }
    }
    // Before a barrier that precedes the next add(): the staging tile is free again.
    __device__ __forceinline__ void wait_staging_free() {
        if constexpr (kStaged) {
            if (threadIdx.x == 0) { bulk_wait(); }
        }
    }
    // At the end of a key block: everything issued has landed (a deterministic CTA adds the same
    // rows again from its next key block, and must do so in order).
    __device__ __forceinline__ void finish() {
        if constexpr (kStaged) {
            __syncthreads();
            flush();
            if (threadIdx.x == 0) { bulk_wait<true>(); }
        }
    }
};

template <typename Traits, bool Is_dropout, bool Is_masked>
__device__ void bwd_key_block(const AttentionParams &params, const SequenceInfo &seq, int n_block, int bidb,
                              int bidh, int dq_accum_split, char *smem) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    const int tidx = threadIdx.x, lane = tidx % 32;
    const int diag = seq.seqlen_k - seq.seqlen_q;
    const bool even_k = params.head_dim == kHeadDim;
    const int kv_rows = seq.seqlen_k - n_block * kBlockN;

    // Query blocks that see any key of this block (the forward's window read backwards).
    int m_block_min = 0, m_block_max = ceil_div(seq.seqlen_q, kBlockM);
    if constexpr (Is_masked) {
        if (params.window_size_right >= 0) {
            const int first_row = n_block * kBlockN - diag - params.window_size_right;
            m_block_min = max(0, first_row >= 0 ? first_row / kBlockM : 0);
        }
        if (params.window_size_left >= 0) {
            const int last_row = (n_block + 1) * kBlockN - 1 - diag + params.window_size_left;
            m_block_max = min(m_block_max, last_row >= 0 ? last_row / kBlockM + 1 : 0);
        }
    }

    const int bidh_k = bidh / params.heads_per_head_k;
    const int64_t k_row0 = seq.k_offset(params.k_batch_stride, params.k_row_stride, bidb) +
                           int64_t(n_block) * kBlockN * params.k_row_stride + int64_t(bidh_k) * params.k_head_stride;
    const int64_t v_row0 = seq.k_offset(params.v_batch_stride, params.v_row_stride, bidb) +
                           int64_t(n_block) * kBlockN * params.v_row_stride + int64_t(bidh_k) * params.v_head_stride;
    const int64_t dk_row0 = seq.k_offset(params.dk_batch_stride, params.dk_row_stride, bidb) +
                            int64_t(n_block) * kBlockN * params.dk_row_stride + int64_t(bidh) * params.dk_head_stride;
    const int64_t dv_row0 = seq.k_offset(params.dv_batch_stride, params.dv_row_stride, bidb) +
                            int64_t(n_block) * kBlockN * params.dv_row_stride + int64_t(bidh) * params.dv_head_stride;

    typename Traits::TiledMmaSdP tiled_mma_sdp;
    typename Traits::TiledMmadKV tiled_mma_dkv;
    typename Traits::TiledMmadQ tiled_mma_dq;
    auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(tidx);
    auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(tidx);
    auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tidx);
    Tensor acc_dk = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor acc_dv = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    clear(acc_dk);
    clear(acc_dv);

    if (m_block_max <= m_block_min) {  // no query sees these keys: their gradients are 0
        store_dkv<Traits>(acc_dk, tiled_mma_dkv, params.dk_ptr, dk_row0, params.dk_row_stride, kv_rows,
                          params.head_dim, 0.f);
        store_dkv<Traits>(acc_dv, tiled_mma_dkv, params.dv_ptr, dv_row0, params.dv_row_stride, kv_rows,
                          params.head_dim, 0.f);
        return;
    }

    // Shared memory: Q[2], dO[2], K, V, P, dS.
    Element *smem_q = reinterpret_cast<Element *>(smem);
    Element *smem_do = smem_q + 2 * size(typename Traits::SmemLayoutQdO{});
    Element *smem_k = smem_do + 2 * size(typename Traits::SmemLayoutQdO{});
    Element *smem_v = smem_k + size(typename Traits::SmemLayoutKV{});
    Element *smem_p = smem_v + size(typename Traits::SmemLayoutKV{});
    Element *smem_ds = smem_p + size(typename Traits::SmemLayoutPdS{});
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
    };
    load_q_do(m_block_min, 0);
    cute::cp_async_fence();

    // Shared -> register copies of the five GEMMs.
    auto smem_copy_A_sdp = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma_sdp);
    auto smem_copy_B_sdp = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma_sdp);
    auto smem_copy_At_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dkv);
    auto smem_copy_Bt_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dkv);
    auto smem_copy_A_dq = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma_dq);
    auto smem_copy_Bt_dq = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dq);
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
    Tensor tScS = thr_mma_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor tScS_rc = make_tensor(tScS.data(), acc_as_rowcol(tScS.layout()));
    constexpr int kRows = decltype(size<0>(tScS_rc))::value;

    // dq_accum rows of this (split, head, sequence); rows past the sequence only ever receive exact
    // zeros (P is 0 there).
    const int64_t dq_row0 = seq.q_start >= 0 ? seq.q_start : int64_t(bidb) * params.seqlen_q_rounded;
    DqAccumWriter<Traits> dq_writer{params.dq_accum_ptr + dq_accum_split * params.dq_accum_split_stride +
                                        int64_t(bidh) * params.dq_accum_head_stride + dq_row0 * kHeadDim,
                                    reinterpret_cast<float *>(smem + Traits::kSmemSize), int(dq_row0 & 7)};
    Tensor tdQcdQ = thr_mma_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));

    const AttentionMask mask = AttentionMask::make(params, seq, bidb, bidh);
    const bool has_alibi = params.alibi_slopes_ptr != nullptr;
    const bool has_softcap = params.softcap > 0.f;
    uint64_t seed = 0, offset = 0;
    if constexpr (Is_dropout) { philox_seed_offset(params.philox, seed, offset); }
    const Dropout dropout(params, seed, offset, bidb, bidh);
    constexpr float kLog2e = 1.4426950408889634f;

    for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
        const int buf = (m_block - m_block_min) % 2;
        cute::cp_async_wait<0>();
        __syncthreads();  // Q/dO[m] (and K, V) landed; every warp is done with the last iteration's tiles
        dq_writer.flush();
        if (m_block + 1 < m_block_max) {
            load_q_do(m_block + 1, buf ^ 1);
            cute::cp_async_fence();
        }

        // This thread's rows: log-sum-exp of the forward (+inf past the sequence: P = 0 there)
        // and softmax_d.
        float lse_log2[kRows], row_d[kRows];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const int row = m_block * kBlockM + get<0>(tScS_rc(r, 0));
            const bool valid = row < seq.seqlen_q;
            const int64_t idx = lse_index(params, seq, bidb, bidh, valid ? row : 0);
            lse_log2[r] = valid ? params.softmax_lse_ptr[idx] * kLog2e : INFINITY;
            row_d[r] = valid ? params.softmax_d_ptr[idx] : 0.f;
        }

        // S = Q K^T and dP = dO V^T, both issued before any element-wise work so that the exp and
        // mask instructions below overlap with the tensor cores still working on dP.
        Tensor acc_s = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        clear(acc_s);
        gemm(acc_s, tSrQ, tSrK, thr_copy_A_sdp.partition_S(sQ(buf)), tSsK, tiled_mma_sdp, smem_copy_A_sdp,
             smem_copy_B_sdp, thr_copy_A_sdp, thr_copy_B_sdp);
        Tensor acc_dp = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        clear(acc_dp);
        gemm(acc_dp, tdPrdO, tdPrV, thr_copy_A_sdp.partition_S(sdO(buf)), tdPsV, tiled_mma_sdp,
             smem_copy_A_sdp, smem_copy_B_sdp, thr_copy_A_sdp, thr_copy_B_sdp);

        // The forward's score modifications, then P = exp(S - lse).
        Tensor scores = make_tensor(acc_s.data(), acc_as_rowcol(acc_s.layout()));
        const bool needs_mask = mask.tile_needs_mask<Is_masked>(
            m_block * kBlockM, (m_block + 1) * kBlockM - 1, n_block * kBlockN, (n_block + 1) * kBlockN - 1);
        if (has_softcap || has_alibi || needs_mask) {
            if (has_softcap) {
                // Stage the derivative 1 - tanh^2 in dS's shared memory until dS is computed.
                Tensor dtanh = make_tensor<float>(acc_s.layout());
                CUTE_UNROLL
                for (int i = 0; i < size(acc_s); ++i) {
                    acc_s(i) = fast_tanh(acc_s(i) * params.softcap_input_scale);
                    dtanh(i) = 1.f - acc_s(i) * acc_s(i);
                }
                Tensor rdtanh = convert_type<Element>(dtanh);
                cute::copy(smem_copy_PdS, thr_copy_PdS.retile_S(rdtanh), tdSsdS);
            }
            if (has_alibi) {
                mask.apply<Is_masked, true>(scores, tScS_rc, m_block * kBlockM, n_block * kBlockN, needs_mask);
            } else if (needs_mask) {
                mask.apply<Is_masked, false>(scores, tScS_rc, m_block * kBlockM, n_block * kBlockN, true);
            }
        }
        CUTE_UNROLL
        for (int r = 0; r < size<0>(scores); ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(scores); ++c) {
                scores(r, c) = exp2f(scores(r, c) * params.scale_softmax_log2 - lse_log2[r]);
            }
        }
        if constexpr (Is_dropout) {  // dropped elements become -P (see dS below)
            dropout.apply<true, false>(scores, tScS_rc, m_block * kBlockM, n_block * kBlockN, lane,
                                       static_cast<Element *>(nullptr), 0);
        }

        // dS = P (dP / p_keep (0 where dropped) - softmax_d) [* (1 - tanh^2)].
        Tensor dp = make_tensor(acc_dp.data(), acc_as_rowcol(acc_dp.layout()));
        Tensor dtanh_staged = make_tensor<Element>(acc_dp.layout());
        if (has_softcap) { cute::copy(smem_copy_PdS, tdSsdS, thr_copy_PdS.retile_D(dtanh_staged)); }
        Tensor dtanh_rc = make_tensor(dtanh_staged.data(), acc_as_rowcol(dtanh_staged.layout()));
        CUTE_UNROLL
        for (int r = 0; r < size<0>(dp); ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(dp); ++c) {
                const float p = scores(r, c);
                const bool kept = p >= 0.f;
                const float dp_kept = Is_dropout ? (kept ? dp(r, c) * params.rp_dropout : 0.f) : dp(r, c);
                float ds = fabsf(p) * (dp_kept - row_d[r]);
                if (has_softcap) { ds *= float(dtanh_rc(r, c)); }
                dp(r, c) = ds;
                scores(r, c) = kept ? p : 0.f;  // P with dropped elements zeroed, for dV
            }
        }
        Tensor rP = convert_type<Element>(acc_s);
        Tensor rdS = convert_type<Element>(acc_dp);
        cute::copy(smem_copy_PdS, thr_copy_PdS.retile_S(rP), tPsP);
        cute::copy(smem_copy_PdS, thr_copy_PdS.retile_S(rdS), tdSsdS);
        dq_writer.wait_staging_free();
        __syncthreads();  // P and dS complete in shared memory; the dQ staging tile is free

        // dV += P^T dO (the 1 / p_keep of dropout is applied once, at the end).
        gemm(acc_dv, tdVrPt, tdVrdOt, tdVsPt, thr_copy_Bt_dkv.partition_S(sdOt(buf)), tiled_mma_dkv,
             smem_copy_At_dkv, smem_copy_Bt_dkv, thr_copy_At_dkv, thr_copy_Bt_dkv);

        // dQ += dS K, into dq_accum in fp32.
        Tensor acc_dq = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        clear(acc_dq);
        gemm(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, tiled_mma_dq, smem_copy_A_dq, smem_copy_Bt_dq,
             thr_copy_A_dq, thr_copy_Bt_dq);
        dq_writer.add(acc_dq, tdQcdQ, m_block);

        // dK += dS^T Q.
        gemm(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, thr_copy_Bt_dkv.partition_S(sQt(buf)), tiled_mma_dkv,
             smem_copy_At_dkv, smem_copy_Bt_dkv, thr_copy_At_dkv, thr_copy_Bt_dkv);
    }

    dq_writer.finish();

    store_dkv<Traits>(acc_dk, tiled_mma_dkv, params.dk_ptr, dk_row0, params.dk_row_stride, kv_rows,
                      params.head_dim, params.softmax_scale);
    store_dkv<Traits>(acc_dv, tiled_mma_dkv, params.dv_ptr, dv_row0, params.dv_row_stride, kv_rows,
                      params.head_dim, Is_dropout ? params.rp_dropout : 1.f);
}

// grid (splits or key blocks, batch, heads): a CTA walks key blocks blockIdx.x, + gridDim.x, ...
// (one block unless deterministic), adding dQ into its own dq_accum split when deterministic.
template <typename Traits, bool Is_dropout, bool Is_masked>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
flash_bwd_kernel(const __grid_constant__ AttentionParams params) {
    extern __shared__ char smem[];
    const int bidb = blockIdx.y, bidh = blockIdx.z;
    const SequenceInfo seq(params, bidb);
    const int n_blocks = ceil_div(seq.seqlen_k, Traits::kBlockN);
    const int split = params.deterministic ? int(blockIdx.x) : 0;
    for (int n_block = blockIdx.x; n_block < n_blocks; n_block += gridDim.x) {
        bwd_key_block<Traits, Is_dropout, Is_masked>(params, seq, n_block, bidb, bidh, split, smem);
        __syncthreads();  // the next key block reuses the shared memory
    }
}

}  // namespace flash
