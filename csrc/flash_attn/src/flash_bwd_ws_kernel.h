// The sm90 backward with warp specialisation (flash_bwd_launch.h: opt-in, FLASH_ATTN_SM90_WS_BWD=1).
// A CTA owns one key block of kBlockN keys (K and V stay in shared memory, dK and dV in registers)
// and walks the query blocks that see it (block_range.h). Three roles:
//  - the producer warp (warp 0) loads K and V once, and each query block's Q and dO with TMA into a
//    kStages ring, with the rows' log-sum-exp and softmax_d beside them (mbarriers);
//  - the dQ warp (warp 1) adds each finished dQ tile from shared memory into dq_accum with one bulk
//    reduction, while the consumers go on;
//  - two consumer warpgroups, each owning 64 of the keys, compute S^T = K Q^T and dP^T = V dO^T on
//    wgmma. With keys as the M dimension, P^T and dS^T come out in registers exactly as the A
//    operands of dV += P^T dO and dK += dS^T Q: only dS goes through shared memory, for
//    dQ = dS K, which the two warpgroups split. At d64 under a mask or on long sequences
//    (kPingPong) they take turns at the tensor cores, so that one's exponentials and dS run
//    under the other's products; elsewhere they meet once a query block.
// The producer warpgroup gives its registers to the consumers (setmaxnreg).
//
// Head dim 256 (BackwardWs::kSplitHeadDim): dK and dV of 64 keys x 256 columns would take a
// consumer 256 registers, so there a CTA owns 64 keys and the warpgroups split the head dim of dK,
// dV and dQ instead: each computes S^T and dP^T for half of the query block's columns, writes P^T
// and dS^T to shared memory (one barrier), and runs dV, dK (both operands in shared memory) and dQ
// over its 128 columns. dQ goes to dq_accum from registers (vector reductions): its 64 KB staging
// tile does not fit beside two Q/dO stages of 32 KB each.
//
// Scope: head dims 64, 128 and 256, padded and varlen inputs, causal / window, ALiBi, softcap,
// dropout (the forward's mask, drawn on S^T: Dropout::apply_transposed), GQA/MQA, the
// deterministic mode (d256: a thread's reductions into its CTA's dq_accum split, in program order).
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "block_range.h"
#include "bwd_epilogue.h"
#include "dropout.h"
#include "flash.h"
#include "philox.h"
#include "score_mods.h"
#include "sequence_info.h"
#include "softmax.h"
#include "tma_rows.h"
#include "utils.h"
#include "wgmma.h"
#include "ws_turns.h"

namespace flash {

using namespace cute;

template <int kHeadDim_, typename Element_>
struct BackwardWs {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    // 64 query rows: at d128 the dK and dV accumulators leave room for no more; at d64 128 rows
    // spilled and were no faster. A third Q/dO stage at d64 (whose stages are small): +10% at 16K.
    // d256: 64 keys, the head dim split between the warpgroups (see the top of the file).
    static constexpr bool kSplitHeadDim = kHeadDim == 256;
    static constexpr int kBlockM = 64, kBlockN = kSplitHeadDim ? 64 : 128, kStages = kHeadDim == 64 ? 3 : 2;
    static constexpr int kConsumerThreads = 256, kThreads = 128 + kConsumerThreads;
    static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256);
    static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= ws_register_pool(kThreads),
                  "setmaxnreg would wait forever for registers the block does not have");

    // S^T and dP^T (kBlockN x kBlockM): warpgroup w owns keys [64 w, 64 w + 64); d256: the 64 keys
    // and queries [32 w, 32 w + 32). d64 (kKVInRegs): K and V, the A operands, from registers
    // (16 each, loaded once a key block): with 64 queries (N) and 64 of the head dim (K) a wgmma
    // with both operands in shared memory reads them about as fast as shared memory gives them
    // (+2-5% at d64 with A in registers, session sixteenth's harness).
    static constexpr bool kKVInRegs = kHeadDim == 64;
    using TiledMmaSdP = std::conditional_t<
        kSplitHeadDim,
        decltype(make_tiled_mma(
            GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM / 2>, Int<kHeadDim>>>(),
            Layout<Shape<_1, _2, _1>>{})),
        std::conditional_t<
            kKVInRegs,
            decltype(make_tiled_mma(
                GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(),
                Layout<Shape<_2, _1, _1>>{})),
            decltype(make_tiled_mma(
                GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(),
                Layout<Shape<_2, _1, _1>>{}))>>;
    // dV += P^T dO and dK += dS^T Q (kBlockN x head dim): the same keys, A from registers; d256:
    // every key, columns [128 w, 128 w + 128), A (P^T, dS^T) from shared memory.
    using TiledMmadKV = std::conditional_t<
        kSplitHeadDim,
        decltype(make_tiled_mma(
            GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / 2>, Int<kBlockM>>,
                                 GMMA::Major::K, GMMA::Major::MN>(),
            Layout<Shape<_1, _2, _1>>{})),
        decltype(make_tiled_mma(
            GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                                 GMMA::Major::MN>(),
            Layout<Shape<_2, _1, _1>>{}))>;
    // dQ = dS K (kBlockM x head dim): the warpgroups split the head dim. At d64 the second one's 32
    // columns of K start 64 bytes into a 128-byte swizzled row (its descriptor's start address, as a
    // K-major operand's k-slices do); the default kernel never reads K so (if only d64's dq is ever
    // wrong, look here first).
    using TiledMmadQ = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / 2>, _16>, GMMA::Major::MN,
                             GMMA::Major::MN>(),
        Layout<Shape<_1, _2, _1>>{}));

    using SmemLayoutKV = SmemKMajor<Element, kBlockN, kHeadDim>;      // K, V: A of S^T, dP^T
    using SmemLayoutKt = SmemColsMajor<Element, kBlockN, kHeadDim>;   // K: B of dQ
    using SmemLayoutQdO = SmemKMajor<Element, kBlockM, kHeadDim>;     // Q, dO (a stage): B of S^T, dP^T
    using SmemLayoutQdOt = SmemColsMajor<Element, kBlockM, kHeadDim>; // the same bytes: B of dK, dV
    using SmemLayoutdSt = SmemKMajor<Element, kBlockN, kBlockM>;      // dS^T (d256: and P^T) as written: A of dK, dV
    using SmemLayoutdS = SmemColsMajor<Element, kBlockN, kBlockM>;    // the same bytes: A of dQ
    static constexpr int kQdOElems = kBlockM * kHeadDim, kdSElems = kBlockN * kBlockM;

    // The consumer warpgroups take turns at the tensor cores (d64 under a mask, or unmasked from
    // kTurnsMinUnmasked queries and keys; see bwd_ws_consumers), or meet once a query block. On an
    // H100 (harness, bf16, 16K tokens, against meeting): under a causal mask +6-10% from 2K keys,
    // level at 1K; unmasked -4% at 1K-4K, +3% at 8K and +6-8% at 16K (session twenty-fifth).
    // The masked d64 units hold only the turns kernel; the unmasked ones both (flash_bwd_launch.h).
    static constexpr bool kPingPong = kHeadDim == 64;
    static constexpr int kTurnsMinUnmasked = 8192;
    static bool unmasked_takes_turns(const AttentionParams &p) {
        return kPingPong && p.seqlen_q >= kTurnsMinUnmasked && p.seqlen_k >= kTurnsMinUnmasked;
    }
    // Named barriers (0 is __syncthreads'): 1 and 2 are the consumers' turns (ws_turns.h, d64);
    // 3: both consumer warpgroups (dS^T of both in shared memory at d128 / d256; the staged dK / dV);
    // 4 + w / 6 + w: warpgroup w's half of a dQ tile written (it arrives, the dQ warp waits) and
    // read (the other way round).
    static constexpr int kBarrierdS = 3, kBarrierDqFull = 4, kBarrierDqEmpty = 6;
    static constexpr int kDqBarrierThreads = 128 + 32;
    // dS^T buffers (the softcap's derivative waits in them too). d128 / d256 alternate two: a
    // buffer's last readers, block i - 2's dQ products, finished before either warpgroup passed
    // barrier 3 at block i - 1. At d64 a block's dQ is issued in the next block's second turn: a
    // buffer may be rewritten once both warpgroups' turns have ordered its last dQ's completion
    // before the writer's, which three buffers ensure (see bwd_ws_consumers); four, so that the
    // buffer index is a mask of the block count.
    static constexpr int kDsBuffers = kPingPong ? 4 : 2;

    struct SharedStorage {
        alignas(1024) cute::array_aligned<Element, kBlockN * kHeadDim> k;
        alignas(1024) cute::array_aligned<Element, kBlockN * kHeadDim> v;
        alignas(1024) cute::array_aligned<Element, kQdOElems * kStages> q;
        alignas(1024) cute::array_aligned<Element, kQdOElems * kStages> dout;
        alignas(1024) cute::array_aligned<Element, kdSElems * kDsBuffers> ds;  // see kDsBuffers
        alignas(1024) cute::array_aligned<Element, kSplitHeadDim ? kdSElems * 2 : 8> p;  // P^T (d256), as ds
        alignas(1024) cute::array_aligned<float, kSplitHeadDim ? 4 : kBlockM * kHeadDim> dq;  // (unused at d256)
        // The stage's rows' lse (the forward's; the consumers scale it by log2(e)) and softmax_d, +inf
        // and 0 past the sequence.
        alignas(16) float lse[kStages][kBlockM];
        alignas(16) float softmax_d[kStages][kBlockM];
        alignas(16) cutlass::arch::ClusterTransactionBarrier full[kStages];  // Q, dO, lse, d of a stage landed
        alignas(16) cutlass::arch::ClusterBarrier empty[kStages];            // the consumers are done with it
        alignas(16) cutlass::arch::ClusterTransactionBarrier kv_full;
        alignas(16) cutlass::arch::ClusterBarrier kv_empty;
    };
    static constexpr int kSmemSize = int(sizeof(SharedStorage));
    static_assert(kSmemSize <= 227 * 1024, "one CTA per SM: the H100/H200 shared memory per block");
    // The staged dK / dV epilogue (bwd_ws_store_dkv_staged): both tiles' rows, padded by 16 bytes
    // (a warp's pair stores then fall on 32 banks), over the Q/dO ring and the dS buffers.
    static constexpr int kDkvRowBytes = kHeadDim * int(sizeof(Element)) + 16;
    static constexpr bool kStagedDkv =
        2 * kBlockN * kDkvRowBytes <= int(offsetof(SharedStorage, p) - offsetof(SharedStorage, q));
    static constexpr uint32_t kBytesQdO = kQdOElems * sizeof(Element);
    static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);
    static constexpr int kDqBytes = kBlockM * kHeadDim * int(sizeof(float));


    using TmaQdO = TmaRowsLoad<Element, SmemLayoutQdO, kBlockM, kHeadDim>;
    using TmaKV = TmaRowsLoad<Element, SmemLayoutKV, kBlockN, kHeadDim>;

    struct KernelArgs {
        AttentionParams params;
        TmaQdO tma_q, tma_do;
        TmaKV tma_k, tma_v;
        bool staged_dkv;  // kStagedDkv, and dk's and dv's rows bulk-storable
    };

    static KernelArgs make_args(const AttentionParams &p) {
        const TmaRowsShape q_shape = q_rows_shape(p), k_shape = k_rows_shape(p);
        auto mQ = tma_rows_tensor<Element>(p.q_ptr, q_shape, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
        auto mdO = tma_rows_tensor<Element>(p.do_ptr, q_shape, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
        auto mK = tma_rows_tensor<Element>(p.k_ptr, k_shape, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
        auto mV = tma_rows_tensor<Element>(p.v_ptr, k_shape, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
        return {p, make_tma_rows_load<SmemLayoutQdO, kBlockM, kHeadDim>(mQ),
                make_tma_rows_load<SmemLayoutQdO, kBlockM, kHeadDim>(mdO),
                make_tma_rows_load<SmemLayoutKV, kBlockN, kHeadDim>(mK),
                make_tma_rows_load<SmemLayoutKV, kBlockN, kHeadDim>(mV),
                kStagedDkv &&
                    bulk_storable(p.dk_ptr, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride, p.head_dim,
                                  int(sizeof(Element))) &&
                    bulk_storable(p.dv_ptr, p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride, p.head_dim,
                                  int(sizeof(Element)))};
    }

    static bool supports(const AttentionParams &p) {
        return tma_rows_cover(p) &&
               tma_loadable({p.q_ptr, p.k_ptr, p.v_ptr, p.do_ptr},
                            {p.q_row_stride, p.q_head_stride, p.q_batch_stride, p.k_row_stride, p.k_head_stride,
                             p.k_batch_stride, p.v_row_stride, p.v_head_stride, p.v_batch_stride,
                             p.do_row_stride, p.do_head_stride, p.do_batch_stride},
                            p.head_dim, int(sizeof(Element)));
    }
};

// A register tensor of wgmma accumulators seen as (cols, rows): S^T's elements indexed (query, key)
// as the score modifications index S.
template <typename Tensor>
CUTE_HOST_DEVICE auto transposed_rowcol(Tensor &&t) {
    auto rc = acc_as_rowcol(t.layout());
    return make_tensor(t.data(), make_layout(get<1>(rc), get<0>(rc)));
}

// Which key blocks a CTA walks (BackwardCta: its split, + splits, ...) and their query blocks.
// Every role walks them alike: body(n_block, range, iter, kv_iter), where `iter` counts the CTA's
// query blocks before this key block (the Q/dO ring's stages and phases, and the dS buffers) and
// `kv_iter` its key blocks that have any (K and V's phases).
template <typename Ws, bool Is_masked>
struct BwdWsSchedule {
    const AttentionParams &params;
    const SequenceInfo &seq;
    const BackwardCta &cta;

    template <typename Body>
    __device__ __forceinline__ void for_each_key_block(Body &&body) const {
        const int n_blocks = ceil_div(seq.seqlen_k, Ws::kBlockN);
        int iter = 0, kv_iter = 0;
        for (int n_block = cta.split; n_block < n_blocks; n_block += cta.splits) {
            const auto range = QueryBlockRange<Ws::kBlockM, Ws::kBlockN, Is_masked>::make(params, seq, n_block);
            body(n_block, range, iter, kv_iter);
            if (!range.empty()) {
                iter += range.m_block_max - range.m_block_min;
                ++kv_iter;
            }
        }
    }
};

// Read by the cp.async of a row past the sequence (a copy's source must be global memory).
static __device__ const float kLsePastSequence = INFINITY;

// The producer warp: K and V of each key block (TMA, once), and each query block's Q and dO (TMA)
// with its rows' lse and softmax_d (cp.async) into the ring's next stage.
template <typename Ws, bool Is_masked>
__device__ __forceinline__ void bwd_ws_producer(const typename Ws::KernelArgs &args,
                                                typename Ws::SharedStorage &storage,
                                                const BwdWsSchedule<Ws, Is_masked> &schedule, const SequenceInfo &seq,
                                                int bidb, int bidh, int lane) {
    using Element = typename Ws::Element;
    constexpr int kBlockM = Ws::kBlockM, kBlockN = Ws::kBlockN, kHeadDim = Ws::kHeadDim, kStages = Ws::kStages;
    const AttentionParams &params = args.params;
    using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
    const int bidh_k = bidh / params.heads_per_head_k;
    Tensor mQ = args.tma_q.get_tma_tensor(q_rows_shape(params));
    Tensor mdO = args.tma_do.get_tma_tensor(q_rows_shape(params));
    Tensor mK = args.tma_k.get_tma_tensor(k_rows_shape(params));
    Tensor mV = args.tma_v.get_tma_tensor(k_rows_shape(params));
    auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
    auto tile_k = Shape<Int<kBlockN>, Int<kHeadDim>>{};
    Tensor gQ = local_tile(sequence_rows(mQ, seq.q_start, bidh, bidb), tile_q, make_coord(_, _0{}));
    Tensor gdO = local_tile(sequence_rows(mdO, seq.q_start, bidh, bidb), tile_q, make_coord(_, _0{}));
    Tensor gK = local_tile(sequence_rows(mK, seq.k_start, bidh_k, bidb), tile_k, make_coord(_, _0{}));
    Tensor gV = local_tile(sequence_rows(mV, seq.k_start, bidh_k, bidb), tile_k, make_coord(_, _0{}));
    auto stages = [](Element *ptr) {
        using Layout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                              Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
        return make_tensor(make_smem_ptr(ptr), Layout{});
    };
    Tensor sQ = stages(storage.q.data()), sdO = stages(storage.dout.data());
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Ws::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Ws::SmemLayoutKV{});
    auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                      group_modes<0, 2>(gQ));
    auto [tdOgdO, tdOsdO] = tma_partition(args.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO),
                                          group_modes<0, 2>(gdO));
    auto [tKgK, tKsK] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                      group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                      group_modes<0, 2>(gV));
    schedule.for_each_key_block([&](int n_block, auto const &range, int iter, int kv_iter) {
        if (range.empty()) { return; }
        if (lane == 0) {  // K and V's buffers are free once the last key block's consumers are done
            if (kv_iter > 0) { storage.kv_empty.wait((kv_iter - 1) % 2); }
            storage.kv_full.arrive_and_expect_tx(2 * Ws::kBytesKV);
            auto &barrier = reinterpret_cast<BarrierType &>(storage.kv_full);
            copy(args.tma_k.with(barrier, 0), tKgK(_, n_block), tKsK);
            copy(args.tma_v.with(barrier, 0), tVgV(_, n_block), tVsV);
        }
        for (int m_block = range.m_block_min; m_block < range.m_block_max; ++m_block, ++iter) {
            const int stage = iter % kStages;
            if (iter >= kStages) { storage.empty[stage].wait((iter / kStages - 1) % 2); }
            if (lane == 0) {
                storage.full[stage].expect_transaction(2 * Ws::kBytesQdO);
                auto &barrier = reinterpret_cast<BarrierType &>(storage.full[stage]);
                copy(args.tma_q.with(barrier, 0), tQgQ(_, m_block), tQsQ(_, stage));
                copy(args.tma_do.with(barrier, 0), tdOgdO(_, m_block), tdOsdO(_, stage));
            }
            // The rows' lse and softmax_d by cp.async, each lane's arrival made when its copies land:
            // the producer goes straight on to the next stage (loads into registers made it wait a
            // global round trip a stage, which the consumers waited for at short keys). Rows past the
            // sequence get +inf and 0 by cp.async too, so the barrier alone orders every write.
            for (int i = lane; i < kBlockM; i += 32) {
                const int row = m_block * kBlockM + i;
                const bool valid = row < seq.seqlen_q;
                const int64_t idx = valid ? lse_index(params, seq, bidb, bidh, row) : 0;
                SM80_CP_ASYNC_CACHEALWAYS<float>::copy(valid ? params.softmax_lse_ptr[idx] : kLsePastSequence,
                                                       storage.lse[stage][i]);
                SM80_CP_ASYNC_CACHEALWAYS_ZFILL<float>::copy(params.softmax_d_ptr[idx], storage.softmax_d[stage][i],
                                                             valid);
            }
            cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t const *>(&storage.full[stage]));
        }
    });
}

// A consumer's publication of its staged dQ half to the dQ warp, made only when `pending` holds:
// the proxy fence (its shared-memory stores, visible to the bulk reduction) and the arrival,
// predicated rather than branched around (a branch while wgmma products run made ptxas serialise
// them).
template <int kThreads>
__device__ __forceinline__ void publish_staged_dq(bool pending, int barrier_id) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p fence.proxy.async.shared::cta;\n"
                 " @p bar.arrive %1, %2;\n}\n" ::"r"(int(pending)), "r"(barrier_id), "n"(kThreads) : "memory");
}

// The dQ warp: each dQ tile the consumers staged in shared memory (each warpgroup its half of the
// head dim, behind its own barrier), added into dq_accum (this sequence's and head's rows) with
// one bulk reduction by lane 0.
template <typename Ws, bool Is_masked>
__device__ __forceinline__ void bwd_ws_dq_writer(typename Ws::SharedStorage &storage,
                                                 const BwdWsSchedule<Ws, Is_masked> &schedule, float *dq_accum,
                                                 int lane) {
    constexpr int kBlockM = Ws::kBlockM, kHeadDim = Ws::kHeadDim;
    schedule.for_each_key_block([&](int, auto const &range, int, int) {
        for (int m_block = range.m_block_min; m_block < range.m_block_max; ++m_block) {
            named_barrier_sync<Ws::kBarrierDqFull, Ws::kDqBarrierThreads>();
            named_barrier_sync<Ws::kBarrierDqFull + 1, Ws::kDqBarrierThreads>();
            if (lane == 0) {
                bulk_add_to_global(dq_accum + int64_t(m_block) * kBlockM * kHeadDim, storage.dq.data(),
                                   Ws::kDqBytes);
                bulk_wait_source_read();
            }
            __syncwarp();
            named_barrier_arrive<Ws::kBarrierDqEmpty, Ws::kDqBarrierThreads>();
            named_barrier_arrive<Ws::kBarrierDqEmpty + 1, Ws::kDqBarrierThreads>();
        }
        // The next key block adds into the same rows: after these have landed (the
        // deterministic order; and the additions land before the CTA goes).
        if (lane == 0) { bulk_wait_done(); }
    });
}

// Where key row key_row of this sequence and head lies in dK or dV (whose strides are given).
__device__ __forceinline__ int64_t dkv_offset(const SequenceInfo &seq, int64_t batch_stride, int64_t row_stride,
                                              int64_t head_stride, int64_t key_row, int bidh) {
    return seq.k_offset(batch_stride, row_stride) + key_row * row_stride + int64_t(bidh) * head_stride;
}

// dK (times softmax_scale) and dV (times dv_scale) of key block n_block, from the consumers'
// registers to the rows of the block that exist.
template <typename Ws, typename Acc, typename TiledMma>
__device__ __forceinline__ void bwd_ws_store_dkv(const AttentionParams &params, const SequenceInfo &seq,
                                                 Acc const &acc_dk, Acc const &acc_dv, TiledMma const &tiled_mma_dkv,
                                                 unsigned ctid, int n_block, int bidh, float dv_scale) {
    using Element = typename Ws::Element;
    constexpr int kBlockN = Ws::kBlockN, kHeadDim = Ws::kHeadDim;
    const int kv_rows = seq.seqlen_k - n_block * kBlockN;
    const int64_t block_row = int64_t(n_block) * kBlockN;
    const int64_t dk_row0 = dkv_offset(seq, params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride,
                                       block_row, bidh);
    const int64_t dv_row0 = dkv_offset(seq, params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride,
                                       block_row, bidh);
    store_dkv<Element, kBlockN, kHeadDim>(acc_dk, tiled_mma_dkv, ctid, params.dk_ptr, dk_row0, params.dk_row_stride,
                                          kv_rows, params.head_dim, params.softmax_scale);
    store_dkv<Element, kBlockN, kHeadDim>(acc_dv, tiled_mma_dkv, ctid, params.dv_ptr, dv_row0, params.dv_row_stride,
                                          kv_rows, params.head_dim, dv_scale);
}

// Where element (key, col) of the key block's dK (dV: kBlockN rows further) is staged, in bytes.
template <typename Ws>
__host__ __device__ constexpr int bwd_dkv_stage_byte(int key, int col) {
    return key * Ws::kDkvRowBytes + col * int(sizeof(typename Ws::Element));
}

// The same through shared memory (Ws::kStagedDkv, the CTA's last key block: no Q or dO is loaded
// after it): dK and dV, scaled, into 16-byte padded rows over the Q/dO ring and the dS buffers,
// then one bulk copy a row that exists (consumer thread t < 2 kBlockN: row t % kBlockN of dK, then of
// dV; at d256, 64 keys a CTA, half the threads copy). On the H200 the stores from registers cost the
// d128 backward 6% at 2K keys (8.5% causal; the harness without any dK / dV stored).
template <typename Ws, typename Acc, typename TiledMma>
__device__ __forceinline__ void bwd_ws_store_dkv_staged(const AttentionParams &params, const SequenceInfo &seq,
                                                        Acc const &acc_dk, Acc const &acc_dv,
                                                        TiledMma const &tiled_mma_dkv, unsigned ctid, int n_block,
                                                        int bidh, float dv_scale, char *stage) {
    using Element = typename Ws::Element;
    constexpr int kBlockN = Ws::kBlockN, kHeadDim = Ws::kHeadDim, kRowBytes = Ws::kDkvRowBytes;
    static_assert(2 * kBlockN <= Ws::kConsumerThreads, "a consumer thread copies at most one row");
    // Every consumer is done reading the block's Q, dO and dS: they become the staging rows.
    named_barrier_sync<Ws::kBarrierdS, Ws::kConsumerThreads>();
    Tensor tc = tiled_mma_dkv.get_thread_slice(ctid).partition_C(
        make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    auto stage_tile = [&](Acc const &acc, char *rows, float scale) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc); i += 2) {  // (i, i + 1): adjacent columns of one row
            cutlass::AlignedArray<Element, 2> pair;
            pair[0] = Element(acc(i) * scale), pair[1] = Element(acc(i + 1) * scale);
            *reinterpret_cast<cutlass::AlignedArray<Element, 2> *>(
                rows + bwd_dkv_stage_byte<Ws>(get<0>(tc(i)), get<1>(tc(i)))) = pair;
        }
    };
    stage_tile(acc_dk, stage, params.softmax_scale);
    stage_tile(acc_dv, stage + kBlockN * kRowBytes, dv_scale);
    cutlass::arch::fence_view_async_shared();  // the rows, visible to the bulk copies
    named_barrier_sync<Ws::kBarrierdS, Ws::kConsumerThreads>();
    const int row = int(ctid) % kBlockN;
    if (int(ctid) < 2 * kBlockN && row < seq.seqlen_k - n_block * kBlockN) {
        const bool is_dv = int(ctid) >= kBlockN;
        const int64_t offset = dkv_offset(seq, is_dv ? params.dv_batch_stride : params.dk_batch_stride,
                                          is_dv ? params.dv_row_stride : params.dk_row_stride,
                                          is_dv ? params.dv_head_stride : params.dk_head_stride,
                                          int64_t(n_block * kBlockN + row), bidh);
        Element *dst = reinterpret_cast<Element *>(is_dv ? params.dv_ptr : params.dk_ptr) + offset;
        SM90_BULK_COPY_S2G::copy(stage + int(ctid) * kRowBytes, dst, params.head_dim * int(sizeof(Element)));
        tma_store_arrive();
        tma_store_wait<0>();  // shared memory outlives the copy's reads
    }
}

// The two consumer warpgroups (threads 128..383, as threads 0..255 of their MMAs): per query block,
// S^T and dP^T, the score modifications, P^T, dropout, dS^T, dV, dK and dQ (handed to the dQ warp);
// per key block, dK and dV out of their registers.
template <typename Ws, bool Is_dropout, bool Is_masked, bool Takes_turns>
__device__ __forceinline__ void bwd_ws_consumers(const AttentionParams &params, typename Ws::SharedStorage &storage,
                                                 const BwdWsSchedule<Ws, Is_masked> &schedule,
                                                 const SequenceInfo &seq, int bidb, int bidh, int64_t dq_row0,
                                                 float *dq_accum, bool staged_dkv) {
    using Element = typename Ws::Element;
    constexpr int kBlockM = Ws::kBlockM, kBlockN = Ws::kBlockN, kHeadDim = Ws::kHeadDim, kStages = Ws::kStages;
    constexpr float kLog2e = 1.4426950408889634f;
    const unsigned ctid = threadIdx.x - 128;
    typename Ws::TiledMmaSdP tiled_mma_sdp;
    typename Ws::TiledMmadKV tiled_mma_dkv;
    typename Ws::TiledMmadQ tiled_mma_dq;
    const int wg_thread0 = warpgroup_first_thread(ctid);  // slices the shared-memory operands
    auto thr_sdp = tiled_mma_sdp.get_thread_slice(ctid);
    auto wg_sdp = tiled_mma_sdp.get_thread_slice(wg_thread0);
    auto wg_dkv = tiled_mma_dkv.get_thread_slice(wg_thread0);
    auto wg_dq = tiled_mma_dq.get_thread_slice(wg_thread0);
    auto sK = smem_view(storage.k.data(), typename Ws::SmemLayoutKV{});
    auto sV = smem_view(storage.v.data(), typename Ws::SmemLayoutKV{});
    // K and V as S^T's and dP^T's A operands: descriptors of shared memory, or (kKVInRegs) this
    // thread's registers, filled with ldmatrix once K and V of a key block have landed.
    auto kv_operand = [&](auto smem) {
        if constexpr (Ws::kKVInRegs) {
            return thr_sdp.partition_fragment_A(smem);
        } else {
            return wg_sdp.partition_fragment_A(smem);
        }
    };
    Tensor tSrK = kv_operand(sK);
    Tensor tSrV = kv_operand(sV);
    Tensor tdQrK = wg_dq.partition_fragment_B(smem_view(storage.k.data(), typename Ws::SmemLayoutKt{}));
    auto stage_of = [](auto &buffer, int stage, int elems) { return buffer.data() + stage * elems; };
    auto tSrQ = [&](int stage) {
        return wg_sdp.partition_fragment_B(
            smem_view(stage_of(storage.q, stage, Ws::kQdOElems), typename Ws::SmemLayoutQdO{}));
    };
    auto tSrdO = [&](int stage) {
        return wg_sdp.partition_fragment_B(
            smem_view(stage_of(storage.dout, stage, Ws::kQdOElems), typename Ws::SmemLayoutQdO{}));
    };
    auto tdKrQ = [&](int stage) {
        return wg_dkv.partition_fragment_B(
            smem_view(stage_of(storage.q, stage, Ws::kQdOElems), typename Ws::SmemLayoutQdOt{}));
    };
    auto tdVrdO = [&](int stage) {
        return wg_dkv.partition_fragment_B(
            smem_view(stage_of(storage.dout, stage, Ws::kQdOElems), typename Ws::SmemLayoutQdOt{}));
    };
    auto tdQrdS = [&](int buf) {
        return wg_dq.partition_fragment_A(
            smem_view(stage_of(storage.ds, buf, Ws::kdSElems), typename Ws::SmemLayoutdS{}));
    };
    // dS^T and (d256) P^T in shared memory, as the consumers write them.
    auto sdSt = [&](int buf) {
        return smem_view(stage_of(storage.ds, buf, Ws::kdSElems), typename Ws::SmemLayoutdSt{});
    };
    auto sPt = [&](int buf) {
        return smem_view(stage_of(storage.p, buf, Ws::kdSElems), typename Ws::SmemLayoutdSt{});
    };
    // d256: P^T and dS^T as the A operands of dV and dK, from shared memory.
    auto tdVrPt = [&](int buf) { return wg_dkv.partition_fragment_A(sPt(buf)); };
    auto tdKrdSt = [&](int buf) { return wg_dkv.partition_fragment_A(sdSt(buf)); };
    // dS^T: registers -> shared memory with stmatrix (each warp stores its own 16 keys' rows, four
    // 8 x 8 tiles an instruction), and back with ldmatrix (the softcap's derivative). Element-wise
    // copies compiled to generic 32-bit stores whose 64-bit addresses stayed live in registers.
    auto smem_copy_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_sdp);
    auto smem_load_ds = make_tiled_copy_C(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, tiled_mma_sdp);
    auto thr_copy_ds = smem_copy_ds.get_thread_slice(ctid);
    auto thr_load_ds = smem_load_ds.get_thread_slice(ctid);
    auto tdSsdS = [&](int buf) { return thr_copy_ds.partition_D(sdSt(buf)); };
    auto tdSsP = [&](int buf) { return thr_copy_ds.partition_D(sPt(buf)); };

    // Each S^T element's (key, query) in the tile, and the same elements as (query, key) for the
    // score modifications (which index S).
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    Tensor tScS_rc = make_tensor(tScS.data(), acc_as_rowcol(tScS.layout()));  // (keys, queries)
    Tensor tScS_qk = thr_sdp.partition_C(
        make_coord_tensor(make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, make_stride(E<1>{}, E<0>{}))));
    Tensor coords_qk = transposed_rowcol(tScS_qk);  // (queries, keys) of (query, key)

    const ScoreMods score_mods = ScoreMods::make(params, seq, bidb, bidh);
    uint64_t seed = 0, offset = 0;
    if constexpr (Is_dropout) { philox_seed_offset(params.philox, seed, offset); }
    const Dropout dropout(params, seed, offset, bidb, bidh);
    int dq_tiles = 0;  // dQ tiles this warpgroup has handed to the dQ warp (d64, d128)
    const int consumer = warpgroup_first_thread(ctid) / 128;  // known uniform: see warpgroup_first_thread

    // A query block's element-wise work, S^T and dP^T in flight (the last wgmma batch issued): the
    // forward's score modifications, P^T = exp(S^T - lse) (columns are queries), dropout, and
    // once dP^T has landed dS^T = P^T (dP^T / keep_prob (0 where dropped) - softmax_d)
    // [* (1 - tanh^2)] in place of dP^T. The softcap's derivative waits in the block's dS buffer
    // (free: see kDsBuffers); each warp reads back only the rows it wrote.
    auto scores_to_ds = [&](auto &acc_s, auto &acc_dp, int stage, int ds_buf, int m_block, int n_block) {
        warpgroup_wait<1>();
        warpgroup_fence_operand(acc_s);
        Tensor scores_qk = transposed_rowcol(acc_s);
        score_mods.apply<kBlockM, kBlockN, Is_masked>(acc_s, scores_qk, coords_qk, m_block, n_block, [&] {
            Tensor rdtanh = ScoreMods::tanh_derivative<Element>(acc_s);
            cute::copy(smem_copy_ds, thr_copy_ds.retile_S(rdtanh), tdSsdS(ds_buf));
        });
        Tensor scores = make_tensor(acc_s.data(), acc_as_rowcol(acc_s.layout()));  // (keys, queries)
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
            const int q_row = get<1>(tScS_rc(0, c));
            const float lse_log2 = storage.lse[stage][q_row] * kLog2e;
            CUTE_UNROLL
            for (int r = 0; r < size<0>(scores); ++r) {
                scores(r, c) = exp2f(scores(r, c) * params.score_scale_log2 - lse_log2);
            }
        }
        if constexpr (Is_dropout) {  // dropped elements become -P (see dS below)
            dropout.apply_transposed<true>(scores, tScS_rc, n_block * kBlockN, m_block * kBlockM,
                                           threadIdx.x % 32);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dp);
        // Two copies of the loop, so that without softcap none of its instructions is issued.
        Tensor dp = make_tensor(acc_dp.data(), acc_as_rowcol(acc_dp.layout()));
        auto compute_ds = [&](auto softcap_on) {
            constexpr bool Has_softcap = decltype(softcap_on)::value;
            Tensor dtanh = make_tensor<Element>(acc_dp.layout());
            if constexpr (Has_softcap) {
                __syncwarp();  // the warp's own stmatrix above: other lanes wrote these rows
                cute::copy(smem_load_ds, thr_load_ds.partition_S(sdSt(ds_buf)), thr_load_ds.retile_D(dtanh));
            }
            Tensor dtanh_rc = make_tensor(dtanh.data(), acc_as_rowcol(dtanh.layout()));
            CUTE_UNROLL
            for (int c = 0; c < size<1>(dp); ++c) {
                const float row_d = storage.softmax_d[stage][get<1>(tScS_rc(0, c))];
                CUTE_UNROLL
                for (int r = 0; r < size<0>(dp); ++r) {
                    dp(r, c) = softmax_grad<Is_dropout, Has_softcap>(scores(r, c), dp(r, c), row_d,
                                                                     params.inv_keep_prob, float(dtanh_rc(r, c)));
                }
            }
        };
        if (score_mods.has_softcap) {
            compute_ds(std::true_type{});
        } else {
            compute_ds(std::false_type{});
        }
    };
    // dQ of query block m_block (this warpgroup's half of the head dim) to shared memory in
    // dq_accum's byte order, for the dQ warp's bulk reduction; published (a proxy fence, which waits
    // for the stores to land, then the arrival) once the next block's first products are issued, so
    // that the stores land under them instead of holding up the warpgroup.
    auto stage_dq = [&](auto const &acc_dq, int m_block) {
        if (dq_tiles > 0) { named_barrier_sync<Ws::kDqBarrierThreads>(Ws::kBarrierDqEmpty + consumer); }
        stage_dq_accum<kBlockM, kHeadDim>(acc_dq, tiled_mma_dq, ctid, storage.dq.data(),
                                          dq_row0 + int64_t(m_block) * kBlockM);
        ++dq_tiles;
    };
    auto publish_dq = [&](bool pending) {
        publish_staged_dq<Ws::kDqBarrierThreads>(pending, Ws::kBarrierDqFull + consumer);
    };

    schedule.for_each_key_block([&](int n_block, auto const &range, int iter, int kv_iter) {
        Tensor acc_dk = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
        Tensor acc_dv = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
        clear(acc_dk);
        clear(acc_dv);
        if (!range.empty()) {
            storage.kv_full.wait(kv_iter % 2);
            if constexpr (Ws::kKVInRegs) {
                auto load_kv = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, tiled_mma_sdp);
                auto thr_load_kv = load_kv.get_thread_slice(ctid);
                cute::copy(load_kv, thr_load_kv.partition_S(sK), thr_load_kv.retile_D(tSrK));
                cute::copy(load_kv, thr_load_kv.partition_S(sV), thr_load_kv.retile_D(tSrV));
            }
            // S^T = K Q^T and dP^T = V dO^T of each query block, both issued before the element-wise
            // work so that dP^T runs on beside the exponentials. Their accumulators are declared
            // once per key block, not per query block: the d128 loop compiled so ran 1-3% faster
            // (session sixteenth's harness; d64 the same).
            Tensor acc_s = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
            Tensor acc_dp = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
            static_assert(!Takes_turns || Ws::kPingPong, "the turns need d64's four dS^T buffers");
            if constexpr (!Takes_turns) {
                // d128, d256 and d64 unmasked short: the warpgroups meet at barrier kBarrierdS every block, for dQ = dS K
                // (both warpgroups' dS^T; d256: and P^T, each warpgroup needing all of both).
                for (int m_block = range.m_block_min; m_block < range.m_block_max; ++m_block, ++iter) {
                    const int stage = iter % kStages, ds_buf = iter % Ws::kDsBuffers;
                    storage.full[stage].wait((iter / kStages) % 2);
                    wgmma_gemm<true, Ws::kKVInRegs>(tiled_mma_sdp, tSrK, tSrQ(stage), acc_s);
                    wgmma_gemm<true, Ws::kKVInRegs>(tiled_mma_sdp, tSrV, tSrdO(stage), acc_dp);
                    if constexpr (!Ws::kSplitHeadDim) { publish_dq(m_block > range.m_block_min); }  // the block before's
                    scores_to_ds(acc_s, acc_dp, stage, ds_buf, m_block, n_block);
                    // dV += P^T dO with dropped elements zeroed (1 / keep_prob is applied once, at
                    // the end), issued before dS^T is converted: P^T's fp32 registers die first,
                    // which keeps the tile from spilling.
                    Tensor rP = convert_type<Element>(acc_s);
                    if constexpr (Ws::kSplitHeadDim) {
                        cute::copy(smem_copy_ds, thr_copy_ds.retile_S(rP), tdSsP(ds_buf));
                    } else {
                        Tensor tdVrP = make_tensor(rP.data(), acc_as_A_operand(rP.layout()));
                        wgmma_gemm<false, true>(tiled_mma_dkv, tdVrP, tdVrdO(stage), acc_dv);
                    }
                    Tensor rdS = convert_type<Element>(acc_dp);
                    // The buffers alternate: a warpgroup writes block i + 1's while the other may
                    // still read block i's, and cannot reach block i + 2 before the other has passed
                    // this barrier at i + 1.
                    cute::copy(smem_copy_ds, thr_copy_ds.retile_S(rdS), tdSsdS(ds_buf));
                    fence_smem_for_wgmma();
                    named_barrier_sync<Ws::kBarrierdS, Ws::kConsumerThreads>();
                    Tensor acc_dq = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
                    wgmma_gemm<true>(tiled_mma_dq, tdQrdS(ds_buf), tdQrK, acc_dq);
                    if constexpr (Ws::kSplitHeadDim) {
                        wgmma_gemm<false>(tiled_mma_dkv, tdVrPt(ds_buf), tdVrdO(stage), acc_dv);
                        wgmma_gemm<false>(tiled_mma_dkv, tdKrdSt(ds_buf), tdKrQ(stage), acc_dk);
                        warpgroup_wait<2>();  // dQ landed; dV and dK may still run
                        warpgroup_fence_operand(acc_dq);
                        add_dq_accum<Ws>(acc_dq, tiled_mma_dq, ctid, dq_accum + int64_t(m_block) * kBlockM * kHeadDim,
                                         dq_row0 + int64_t(m_block) * kBlockM);
                    } else {
                        Tensor tdKrdS = make_tensor(rdS.data(), acc_as_A_operand(rdS.layout()));
                        wgmma_gemm<false, true>(tiled_mma_dkv, tdKrdS, tdKrQ(stage), acc_dk);
                        warpgroup_wait<1>();  // dV and dQ landed; dK may still run
                        warpgroup_fence_operand(rP);  // P^T's registers were read by dV until here
                        warpgroup_fence_operand(acc_dq);
                        stage_dq(acc_dq, m_block);
                    }
                    warpgroup_wait<0>();
                    warpgroup_fence_operand(acc_dk);
                    warpgroup_fence_operand(acc_dv);
                    warpgroup_fence_operand(rdS);  // dS^T's registers were read by dK until here
                    storage.empty[stage].arrive();
                }
                if constexpr (!Ws::kSplitHeadDim) { publish_dq(true); }  // the last block's
            } else {
                // d64 under a mask or long: the warpgroups take turns at the tensor cores (ping-pong), two a
                // block: S^T and dP^T; then dQ of the block before (both warpgroups' dS^T, written
                // before their last turn), dV and dK. One's element-wise work runs under the
                // other's products. A block's dQ waits a block because the other warpgroup's half
                // of its dS^T is written only after this one's second turn; the last block's dQ
                // is issued after the loop.
                Tensor acc_dq = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
                // A block's two turns; has_last: the block before's dQ is issued in the second (all
                // blocks but the first). A compile-time flag, so that no turn issues a wgmma under a
                // branch: a branch there made ptxas serialise the d128 version of this loop.
                auto block = [&](int m_block, auto has_last_t) {
                    constexpr bool has_last = decltype(has_last_t)::value;
                    const int stage = iter % kStages, ds_buf = iter % Ws::kDsBuffers;
                    const int last_ds_buf = (iter + Ws::kDsBuffers - 1) % Ws::kDsBuffers;
                    storage.full[stage].wait((iter / kStages) % 2);
                    ws_wait_turn<2>(consumer);
                    wgmma_gemm<true, Ws::kKVInRegs>(tiled_mma_sdp, tSrK, tSrQ(stage), acc_s);
                    wgmma_gemm<true, Ws::kKVInRegs>(tiled_mma_sdp, tSrV, tSrdO(stage), acc_dp);
                    ws_pass_turn<2>(consumer);
                    // the dQ of two blocks back, staged in the block before
                    if constexpr (has_last) { publish_dq(m_block > range.m_block_min + 1); }
                    scores_to_ds(acc_s, acc_dp, stage, ds_buf, m_block, n_block);
                    Tensor rP = convert_type<Element>(acc_s);
                    Tensor rdS = convert_type<Element>(acc_dp);
                    cute::copy(smem_copy_ds, thr_copy_ds.retile_S(rdS), tdSsdS(ds_buf));
                    fence_smem_for_wgmma();  // read by dQ's wgmma after the other's turn barrier

                    ws_wait_turn<2>(consumer);
                    if constexpr (has_last) { wgmma_gemm<true>(tiled_mma_dq, tdQrdS(last_ds_buf), tdQrK, acc_dq); }
                    Tensor tdVrP = make_tensor(rP.data(), acc_as_A_operand(rP.layout()));
                    wgmma_gemm<false, true>(tiled_mma_dkv, tdVrP, tdVrdO(stage), acc_dv);
                    Tensor tdKrdS = make_tensor(rdS.data(), acc_as_A_operand(rdS.layout()));
                    wgmma_gemm<false, true>(tiled_mma_dkv, tdKrdS, tdKrQ(stage), acc_dk);
                    ws_pass_turn<2>(consumer);
                    if constexpr (has_last) {
                        warpgroup_wait<2>();  // dQ landed; dV and dK may still run
                        warpgroup_fence_operand(acc_dq);
                        stage_dq(acc_dq, m_block - 1);
                    }
                    warpgroup_wait<0>();
                    warpgroup_fence_operand(acc_dk);
                    warpgroup_fence_operand(acc_dv);
                    warpgroup_fence_operand(rP);   // read by dV until here
                    warpgroup_fence_operand(rdS);  // read by dK until here
                    storage.empty[stage].arrive();
                    ++iter;
                };
                if (consumer == 1) { ws_pass_turn<2>(consumer); }  // opens consumer 0's first turn
                block(range.m_block_min, std::false_type{});
                for (int m_block = range.m_block_min + 1; m_block < range.m_block_max; ++m_block) {
                    block(m_block, std::true_type{});
                }
                // The last block's dQ: consumer 0 waits for consumer 1's last turn (its dS^T
                // written), which passes no more; consumer 1 saw consumer 0's dS^T at its own last
                // turn. Every arrival of a key block is waited for within it.
                publish_dq(range.m_block_max - range.m_block_min >= 2);  // the last block's staged dQ
                if (consumer == 0) { ws_wait_turn<2>(consumer); }
                wgmma_gemm<true>(tiled_mma_dq, tdQrdS((iter + Ws::kDsBuffers - 1) % Ws::kDsBuffers), tdQrK, acc_dq);
                warpgroup_wait<0>();
                warpgroup_fence_operand(acc_dq);
                stage_dq(acc_dq, range.m_block_max - 1);
                publish_dq(true);
            }
            storage.kv_empty.arrive();
        }

        const float dv_scale = Is_dropout ? params.inv_keep_prob : 1.f;
        bool staged = false;
        if constexpr (Ws::kStagedDkv) {
            staged = staged_dkv && n_block + schedule.cta.splits >= ceil_div(seq.seqlen_k, kBlockN);
            if (staged) {
                bwd_ws_store_dkv_staged<Ws>(params, seq, acc_dk, acc_dv, tiled_mma_dkv, ctid, n_block, bidh,
                                            dv_scale, reinterpret_cast<char *>(storage.q.data()));
            }
        }
        if (!staged) { bwd_ws_store_dkv<Ws>(params, seq, acc_dk, acc_dv, tiled_mma_dkv, ctid, n_block, bidh, dv_scale); }
    });
    // The dQ warp's last release: every arrival at a named barrier is waited for.
    if (dq_tiles > 0) { named_barrier_sync<Ws::kDqBarrierThreads>(Ws::kBarrierDqEmpty + consumer); }
}

// grid: BackwardCta's. Deterministic: each CTA adds its dQ tiles into its own dq_accum split, one
// key block's after the last one's have landed, so every element sums in a fixed order.
template <typename Ws, bool Is_dropout, bool Is_masked, bool Takes_turns>
__global__ void __launch_bounds__(Ws::kThreads, 1)
flash_bwd_ws_kernel(const __grid_constant__ typename Ws::KernelArgs args) {
#if FLASH_WGMMA_ARCH
    const AttentionParams &params = args.params;
    extern __shared__ __align__(1024) char smem_raw[];
    auto &storage = *reinterpret_cast<typename Ws::SharedStorage *>(smem_raw);

    if (threadIdx.x == 0) {
        for (int stage = 0; stage < Ws::kStages; ++stage) {
            storage.full[stage].init(32);  // every producer lane, as its lse / d copies land
            storage.empty[stage].init(Ws::kConsumerThreads);
        }
        storage.kv_full.init(1);
        storage.kv_empty.init(Ws::kConsumerThreads);
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();  // barriers initialised before anyone waits on them

    const BackwardCta cta = BackwardCta::make(params);
    const int bidb = cta.bidb, bidh = cta.bidh;
    const SequenceInfo seq(params, bidb);
    const BwdWsSchedule<Ws, Is_masked> schedule{params, seq, cta};
    // dq_accum rows of this sequence and head, in this CTA's split when deterministic.
    const int64_t dq_row0 = seq.q_start >= 0 ? seq.q_start : int64_t(bidb) * params.seqlen_q_rounded;
    float *dq_accum = params.dq_accum_ptr + cta.dq_split * params.dq_accum_split_stride +
                      int64_t(bidh) * params.dq_accum_head_stride + dq_row0 * Ws::kHeadDim;

    if (threadIdx.x / 128 == 0) {  // the producer warpgroup: warps 0 and 1 work, 2 and 3 leave
        cutlass::arch::warpgroup_reg_dealloc<Ws::kProducerRegisters>();
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (warp == 0) {
            bwd_ws_producer<Ws>(args, storage, schedule, seq, bidb, bidh, lane);
        } else if (warp == 1 && !Ws::kSplitHeadDim) {  // d256: the consumers add dQ themselves
            bwd_ws_dq_writer<Ws>(storage, schedule, dq_accum, lane);
        }
        return;
    }
    cutlass::arch::warpgroup_reg_alloc<Ws::kConsumerRegisters>();
    bwd_ws_consumers<Ws, Is_dropout, Is_masked, Takes_turns>(params, storage, schedule, seq, bidb, bidh, dq_row0,
                                                             dq_accum, args.staged_dkv);
#else
    __trap();  // only sm_90a images reach here; never leave the gradients unwritten
#endif
}

}  // namespace flash
