// The attention forward kernel (sm80-class mma.sync path): one CTA computes kBlockM query rows
// of one (batch, head) against every key block they may see, with an online softmax.
//
// Per key block, from the last to the first: S = Q K^T (tensor cores, K from shared memory),
// softcap, mask and ALiBi, online softmax, dropout, O += P V (P straight from registers). On
// sm90 the two products run on wgmma where the tile allows (wgmma.h), else on mma.sync.
// cp.async loads V of this block during S = Q K^T and K of the next block during P V.
//
// The pieces it wires together: which key blocks it walks (block_range.h: the mask's bounds
// and the split-KV share), the loads (contiguous, or paged with a row gather: paged_kv.h), the
// score modifications (score_mods.h, shared with the backward), the main loop, and where the
// results go (fwd_epilogue.h: final O + lse, or a split's partial O + lse).
#pragma once

#include <cute/tensor.hpp>

#include "block_range.h"
#include "dropout.h"
#include "flash.h"
#include "fwd_epilogue.h"
#include "kernel_traits.h"
#include "paged_kv.h"
#include "score_mods.h"
#include "sequence_info.h"
#include "softmax.h"
#include "tile_sizes.h"
#include "utils.h"
#include "wgmma.h"

namespace flash {

using namespace cute;

template <typename Traits, bool Is_dropout, bool Is_masked>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
flash_fwd_kernel(const __grid_constant__ AttentionParams params) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;

    extern __shared__ __align__(1024) char smem[];  // 1024: the swizzled tiles as wgmma reads them
    // Heaviest query blocks first (under a causal mask the last rows see the most keys), so that
    // the light ones fill the tail of the grid.
    const int m_block = gridDim.x - 1 - blockIdx.x, bidb = blockIdx.y;
    // Heads vary fastest along z so that the CTAs of one GQA group (same K/V) run side by side.
    const int bidh = blockIdx.z % params.heads, split = blockIdx.z / params.heads;
    const int tidx = threadIdx.x, lane = tidx % 32;

    if constexpr (Is_dropout) {
        if (m_block == 0 && bidb == 0 && bidh == 0 && tidx == 0) {
            uint64_t seed, offset;
            philox_seed_offset(params.philox, seed, offset);
            params.rng_state[0] = int64_t(seed);
            params.rng_state[1] = int64_t(offset);
        }
    }

    const SequenceInfo seq(params, bidb);
    if (m_block * kBlockM >= seq.seqlen_q) { return; }
    const auto range = KeyBlockRange<kBlockM, kBlockN, Is_masked>::make(params, seq, m_block, split);
    const int n_block_min = range.n_block_min, n_block_max = range.n_block_max;

    const int64_t q_offset = seq.q_offset(params.q_batch_stride, params.q_row_stride, bidb);
    const int64_t o_offset = seq.q_offset(params.o_batch_stride, params.o_row_stride, bidb);
    Tensor mO = make_tensor(make_gmem_ptr(reinterpret_cast<Element *>(params.o_ptr) + o_offset),
                            make_shape(seq.seqlen_q, params.heads, params.head_dim),
                            make_stride(params.o_row_stride, params.o_head_stride, _1{}));
    Tensor gO = local_tile(mO(_, bidh, _), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
    if (range.empty()) {
        write_empty_rows<Traits>(params, seq, gO, m_block, bidb, bidh, split);
        return;
    }

    Tensor mQ = make_tensor(make_gmem_ptr(reinterpret_cast<Element *>(params.q_ptr) + q_offset),
                            make_shape(seq.seqlen_q, params.heads, params.head_dim),
                            make_stride(params.q_row_stride, params.q_head_stride, _1{}));
    Tensor gQ = local_tile(mQ(_, bidh, _), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
    // K/V: a (kBlockN, kHeadDim) window whose base moves to each key block (paged or not).
    const int bidh_k = bidh / params.heads_per_head_k;
    const bool paged = params.block_table != nullptr;
    // Paged: the window's base stays at the head, and each row is placed through the block table.
    Element *k_base = reinterpret_cast<Element *>(params.k_ptr) + int64_t(bidh_k) * params.k_head_stride +
                      (paged ? 0 : seq.k_offset(params.k_batch_stride, params.k_row_stride));
    Element *v_base = reinterpret_cast<Element *>(params.v_ptr) + int64_t(bidh_k) * params.v_head_stride +
                      (paged ? 0 : seq.k_offset(params.v_batch_stride, params.v_row_stride));
    Tensor gK = make_tensor(make_gmem_ptr(k_base), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                            make_stride(params.k_row_stride, _1{}));
    Tensor gV = make_tensor(make_gmem_ptr(v_base), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                            make_stride(params.v_row_stride, _1{}));

    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element *>(smem)), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
    Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});
    static_assert(kBlockN <= Traits::kNThreads, "paged lookups: one thread per key row");
    const PagedRows<kBlockN> paged_rows(reinterpret_cast<int *>(smem + Traits::kSmemQSize + Traits::kSmemKVSize));

    // Global -> shared copies, with predicates for the head dim and the sequence ends.
    typename Traits::GmemTiledCopyQKV gmem_tiled_copy;
    auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
    Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
    Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
    Tensor tKgK = gmem_thr_copy.partition_S(gK);
    Tensor tKsK = gmem_thr_copy.partition_D(sK);
    Tensor tVgV = gmem_thr_copy.partition_S(gV);
    Tensor tVsV = gmem_thr_copy.partition_D(sV);
    const auto tKgK_base = tKgK.data();
    const auto tVgV_base = tVgV.data();
    Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    Tensor tQpQ = col_predicates(tQcQ, params.head_dim);
    Tensor tKVpKV = col_predicates(tKVcKV, params.head_dim);

    const bool even_k = params.head_dim == kHeadDim;
    // The decode tile is bound by memory, and one tile in flight per CTA is too little: it keeps
    // two (K[n - 1] starts as soon as S no longer reads K[n], beside V[n]; V[n] as soon as P V no
    // longer reads V[n + 1], beside K[n]), for two more barriers per block. The larger tiles do
    // enough math per block to hide a single load.
    constexpr bool kEarlyKLoad = kBlockM == kDecodeBlockM;
    // One key block of K or V into shared memory: contiguous rows move as one strided window; paged
    // rows each start where the block table puts them (a page may be shorter than the block): the
    // block's lookups (paged_rows) were stored before a barrier the load comes after.
    auto load_kv = [&](auto &tgmem, auto const &tgmem_base, auto &tsmem, int n_block, int64_t batch_stride,
                       int64_t row_stride) {
        const int rows = seq.seqlen_k - n_block * kBlockN;
        if (!paged) {
            tgmem.data() = tgmem_base + int64_t(n_block) * kBlockN * row_stride;
            copy_tile(gmem_tiled_copy, tgmem, tsmem, tKVcKV, tKVpKV, rows, even_k && rows >= kBlockN);
        } else {
            tgmem.data() = tgmem_base;
            copy_tile_rows(gmem_tiled_copy, tgmem, tsmem, tKVcKV, tKVpKV, rows,
                           [&](int row) { return paged_rows.shift(n_block, row, batch_stride, row_stride); });
        }
    };
    auto load_k = [&](int n_block) {
        load_kv(tKgK, tKgK_base, tKsK, n_block, params.k_batch_stride, params.k_row_stride);
    };
    auto load_v = [&](int n_block) {
        load_kv(tVgV, tVgV_base, tVsV, n_block, params.v_batch_stride, params.v_row_stride);
    };

    // The two GEMMs: mma.sync with shared -> register operand copies, or wgmma (S from shared
    // memory, O += P V with P in registers); accumulators are laid out by the MMA that computes them.
    using Wgmma = ForwardWgmma<Traits>;
    constexpr bool kWgmma = Wgmma::kEnabled;
    typename Traits::TiledMma tiled_mma;
    typename Wgmma::TiledMmaS tiled_mma_s;
    typename Wgmma::TiledMmaO tiled_mma_o;
    const int wg_thread0 = kWgmma ? warpgroup_first_thread(tidx) : 0;  // slices the shared-memory operands
    auto thr_mma = tiled_mma.get_thread_slice(tidx);
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
    Tensor tSrK = thr_mma.partition_fragment_B(sK);
    Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
    Tensor acc_o = partition_fragment_C(tiled_mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});

    auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(tidx);
    Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);
    auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(tidx);
    Tensor tSsK = smem_thr_copy_K.partition_S(sK);
    auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
    auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(tidx);
    Tensor tOsVt = smem_thr_copy_V.partition_S(sVt);

    // (row, col) inside the tile of each score element this thread holds, as (rows, cols).
    Tensor tScS =
        tiled_mma_s.get_thread_slice(tidx).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor tScS_rc = make_tensor(tScS.data(), acc_as_rowcol(tScS.layout()));

    const ScoreMods score_mods = ScoreMods::make(params, seq, bidb, bidh);

    uint64_t seed = 0, offset = 0;
    if constexpr (Is_dropout) { philox_seed_offset(params.philox, seed, offset); }
    const Dropout dropout(params, seed, offset, bidb, bidh);
    Element *s_dmask = params.s_dmask_ptr == nullptr ? nullptr
        : reinterpret_cast<Element *>(params.s_dmask_ptr) +
              (int64_t(bidb) * params.heads + bidh) * params.seqlen_q_rounded * params.seqlen_k_rounded;

    // Prologue: Q and the last key block.
    const int q_rows = seq.seqlen_q - m_block * kBlockM;
    copy_tile(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, tQpQ, q_rows, even_k && q_rows >= kBlockM);
    // Paged: the rows of the next key block wait in a register for one iteration, so the table read
    // of block n - 2 has a whole iteration (two loads) to return before its store.
    typename PagedRows<kBlockN>::Row next_row{};
    if (paged) {
        paged_rows.store(n_block_max - 1, tidx, paged_rows.fetch(params, seq, bidb, n_block_max - 1, tidx));
        if (n_block_max - 2 >= n_block_min) { next_row = paged_rows.fetch(params, seq, bidb, n_block_max - 2, tidx); }
        __syncthreads();
    }
    load_k(n_block_max - 1);
    cute::cp_async_fence();

    clear(acc_o);
    Tensor acc_o_rowcol = make_tensor(acc_o.data(), acc_as_rowcol(acc_o.layout()));
    constexpr int kRows = decltype(size<0>(acc_o_rowcol))::value;
    OnlineSoftmax<kRows> softmax;

    for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
        Tensor acc_s = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
        if constexpr (kEarlyKLoad) {
            // V[n] starts before K[n] is waited for, so that two tiles are in flight at every wait.
            __syncthreads();  // every warp is done reading V[n + 1]
            load_v(n_block);
            cute::cp_async_fence();
            cute::cp_async_wait<1>();
            if constexpr (kWgmma) { fence_smem_for_wgmma(); }
            __syncthreads();  // K[n] landed
        } else {
            cute::cp_async_wait<0>();
            if constexpr (kWgmma) { fence_smem_for_wgmma(); }
            __syncthreads();  // K[n] landed; every warp is done reading V[n + 1]
            load_v(n_block);
            cute::cp_async_fence();
        }
        // Paged: block n - 2's rows are read from the block table now; block n - 1's (read an
        // iteration ago) are stored before the barrier its K load follows (the buffer they go to was
        // last read by load_v(n_block + 1)).
        const bool store_next = paged && n_block > n_block_min;
        typename PagedRows<kBlockN>::Row ahead_row{};
        if (paged && n_block - 1 > n_block_min) { ahead_row = paged_rows.fetch(params, seq, bidb, n_block - 2, tidx); }

        if constexpr (kWgmma) {
            auto wg_s = tiled_mma_s.get_thread_slice(wg_thread0);
            wgmma_gemm<true>(tiled_mma_s,
                             wg_s.partition_fragment_A(smem_view(sQ.data().get(), typename Wgmma::SmemLayoutQ{})),
                             wg_s.partition_fragment_B(smem_view(sK.data().get(), typename Wgmma::SmemLayoutK{})),
                             acc_s);
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_s);
        } else {
            clear(acc_s);
            gemm(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_Q, smem_tiled_copy_K,
                 smem_thr_copy_Q, smem_thr_copy_K);
        }

        Tensor scores = make_tensor(acc_s.data(), acc_as_rowcol(acc_s.layout()));
        score_mods.apply<kBlockM, kBlockN, Is_masked>(acc_s, scores, tScS_rc, m_block, n_block, [] {});

        if (store_next) {
            paged_rows.store(n_block - 1, tidx, next_row);
            next_row = ahead_row;
        }
        if constexpr (kEarlyKLoad) {
            __syncthreads();  // every warp is done reading K[n]: K[n - 1] loads beside V[n]
        } else {
            cute::cp_async_wait<0>();
            if constexpr (kWgmma) { fence_smem_for_wgmma(); }
            __syncthreads();  // V[n] landed; every warp is done reading K[n]
        }
        if (n_block > n_block_min) {
            load_k(n_block - 1);
            cute::cp_async_fence();
        }

        softmax.update(scores, acc_o_rowcol, params.score_scale_log2);
        if constexpr (Is_dropout) {
            if (s_dmask != nullptr) {
                dropout.apply<false, true>(scores, tScS_rc, m_block * kBlockM, n_block * kBlockN, lane,
                                           s_dmask, params.seqlen_k_rounded);
            } else {
                dropout.apply<false, false>(scores, tScS_rc, m_block * kBlockM, n_block * kBlockN, lane,
                                            s_dmask, params.seqlen_k_rounded);
            }
        }

        Tensor rP = convert_type<Element>(acc_s);
        Tensor tOrP = make_tensor(rP.data(), acc_as_A_operand(rP.layout()));
        if constexpr (kEarlyKLoad) {
            if (n_block > n_block_min) {
                cute::cp_async_wait<1>();  // V[n]; K[n - 1] may still be in flight
            } else {
                cute::cp_async_wait<0>();
            }
            if constexpr (kWgmma) { fence_smem_for_wgmma(); }
            __syncthreads();  // V[n] landed
        }
        if constexpr (kWgmma) {
            wgmma_gemm<false, true>(tiled_mma_o, tOrP,
                                    tiled_mma_o.get_thread_slice(wg_thread0).partition_fragment_B(
                                        smem_view(sV.data().get(), typename Wgmma::SmemLayoutVt{})),
                                    acc_o);
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_o);
        } else {
            gemm<true>(acc_o, tOrP, tOrVt, tOrP, tOsVt, tiled_mma, smem_tiled_copy_V, smem_tiled_copy_V,
                       smem_thr_copy_V, smem_thr_copy_V);
        }
    }

    // Epilogue: normalise; a split writes its partial result, else O is staged through shared
    // memory for coalesced 16-byte stores and lse written.
    const bool partial = params.num_splits > 1;
    float lse[kRows];
    softmax.finalize(acc_o_rowcol, params.score_scale, Is_dropout ? params.inv_keep_prob : 1.f, lse,
                     partial ? -INFINITY : INFINITY);
    if (partial) {
        Tensor tOcO = tiled_mma_o.get_thread_slice(tidx).partition_C(
            make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
        Tensor tOcO_rc = make_tensor(tOcO.data(), acc_as_rowcol(tOcO.layout()));
        store_partial<kBlockM>(params, seq, acc_o_rowcol, tOcO_rc, lse, m_block, bidb, bidh, split);
        return;
    }

    Tensor rO = convert_type<Element>(acc_o);
    // Q's shared memory is free: its last reader (S = Q K^T) finished before the loop's last barrier.
    Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});
    auto smem_tiled_copy_O = make_tiled_copy_C(typename Traits::SmemCopyAtomAcc{}, tiled_mma_o);
    auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(tidx);
    Tensor taccOrO = smem_thr_copy_O.retile_S(rO);
    Tensor taccOsO = smem_thr_copy_O.partition_D(sO);
    cute::copy(smem_tiled_copy_O, taccOrO, taccOsO);

    if (get<1>(tScS_rc(0, 0)) == 0) {  // one of the quad's lanes writes the row statistics
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const int row = m_block * kBlockM + get<0>(tScS_rc(r, 0));
            if (row < seq.seqlen_q) { params.softmax_lse_ptr[lse_index(params, seq, bidb, bidh, row)] = lse[r]; }
        }
    }

    __syncthreads();
    typename Traits::GmemTiledCopyO gmem_tiled_copy_O;
    auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
    Tensor tOsO = gmem_thr_copy_O.partition_S(sO);
    Tensor tOgO = gmem_thr_copy_O.partition_D(gO);
    Tensor tOrO = make_tensor<Element>(shape(tOgO));
    cute::copy(gmem_tiled_copy_O, tOsO, tOrO);
    store_o_tile<Traits>(params, tOrO, tOgO, q_rows);
}

}  // namespace flash
