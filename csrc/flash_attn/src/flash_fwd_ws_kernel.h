// The sm90 forward with warp specialisation (flash_fwd_launch.h: from 1K or 2K keys by head dim, or as
// FLASH_ATTN_SM90_WS says). One producer warpgroup issues TMA loads of Q and of K/V tiles into a
// kStages-deep shared-memory ring tracked by mbarriers (CUTLASS's PipelineTmaAsync), and gives its
// registers to the consumer warpgroups (setmaxnreg; two, or three in d64's wide tile), which own 64
// query rows each and run S = Q K^T and O += P V on wgmma, the softmax and the score modifications
// (the pieces of the mma.sync/wgmma kernel: score_mods.h, softmax.h, block_range.h). Mode 2
// (Overlap) issues S of block j + 1 with P V of block j and has the consumers take turns (ping-pong).
//
// The CTAs are persistent (one per SM, WsSchedule): each walks work units of one query block, or
// under a mask two (m and its mirror, so every unit has the same number of key blocks), and the
// producer loads the next unit's Q and K/V while the consumers write the last one's O.
//
// Scope: padded and varlen (not paged, no seqused_k / left padding) inputs, no dropout, no
// split-KV, head dims 64, 128, 192 and 256 (tiles: WsForwardTile). The epilogue: fwd_ws_epilogue.h.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "block_range.h"
#include "flash.h"
#include "fwd_ws_epilogue.h"
#include "score_mods.h"
#include "sequence_info.h"
#include "softmax.h"
#include "tma_rows.h"
#include "utils.h"
#include "wgmma.h"
#include "ws_turns.h"

namespace flash {

using namespace cute;

// kConsumers warpgroups of 64 query rows each; kBlockN keys per K/V stage (tile_sizes.h: WsForwardTile).
template <int kHeadDim_, typename Element_, int kConsumers_, int kBlockN_>
struct ForwardWs {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_, kConsumers = kConsumers_, kBlockN = kBlockN_, kStages = 2;
    static constexpr int kBlockM = 64 * kConsumers;
    static constexpr int kConsumerThreads = 128 * kConsumers, kThreads = 128 + kConsumerThreads;
    // Registers per thread once the producer gives its own up: all of the block's.
    static constexpr int kProducerRegisters = 24, kConsumerRegisters = kConsumers == 2 ? 240 : 160;
    static_assert(kConsumers == 2 || kConsumers == 3);
    static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= ws_register_pool(kThreads),
                  "setmaxnreg would wait forever for registers the block does not have");

    // S = Q K^T (both from shared memory) and O += P V (P from registers), a warpgroup per 64 rows.
    using Wgmma = ForwardWgmmaTile<Element, kConsumers, kBlockM, kBlockN, kHeadDim>;
    using TiledMmaS = typename Wgmma::TiledMmaS;
    using TiledMmaO = typename Wgmma::TiledMmaO;
    static_assert(size<1>(typename TiledMmaS::AtomShape_MNK{}) == kBlockN,
                  "S on one wgmma per k-slice (widths past 128 other than powers of two need "
                  "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, set by csrc/build_flags.py)");

    using SmemLayoutQ = typename Wgmma::SmemLayoutQ;
    using SmemLayoutKV = typename Wgmma::SmemLayoutK;    // one stage; K: B of S (keys x head dim)
    using SmemLayoutVt = typename Wgmma::SmemLayoutVt;   // a V stage as B of O (head dim x keys)
    using SmemLayoutKVStages = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                      Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
    static constexpr int kTileElems = kBlockN * kHeadDim;

    using Pipeline = cutlass::PipelineTmaAsync<kStages>;
    using PipelineState = typename Pipeline::PipelineState;

    // O's epilogue through shared memory (fwd_ws_epilogue.h) at d64 and d128 (two consumers): each
    // consumer's 64 rows staged in a 128-byte-swizzled tile (the accumulator's pair stores then hit
    // 32 different banks a warp) and written with one TMA store; two tiles a consumer, so that a
    // block writes one while the last block's store reads the other. On the H200 (harness, bf16,
    // two consumers) against one bulk copy a row at d128: +1.5-6% unmasked, +1-2.5% causal; at d64,
    // against stores from registers: +3-7% at 1K-2K keys, even from 4K.
    using SmemLayoutOStage = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                    Shape<_64, Int<kHeadDim>>{}));
    template <bool kStaged>
    struct SharedStorageOf {
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKVStages>> k;
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKVStages>> v;
        alignas(1024) cute::array_aligned<Element, kStaged ? 2 * kConsumers * cosize_v<SmemLayoutOStage> : 8> o;
        typename Pipeline::SharedStorage pipeline_k, pipeline_v;
        alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;  // Q landed (the producer's expect-tx)
        alignas(16) cutlass::arch::ClusterBarrier barrier_q_empty;        // the consumers are done with Q
        float wait_anchor[kConsumerThreads];  // written, never read: see anchor_wait_after
    };
    // Two consumers only: beside three consumers' 160 registers the staged code spilled (d64: 112-228
    // bytes, into the main loop).
    static constexpr bool kStagedO = kHeadDim <= 128 && kConsumers == 2 && sizeof(SharedStorageOf<true>) <= 227 * 1024;
    using SharedStorage = SharedStorageOf<kStagedO>;
    static constexpr int kSmemSize = int(sizeof(SharedStorage));
    static_assert(kSmemSize <= 227 * 1024, "one CTA per SM: the H100/H200 shared memory per block");

    using TmaQ = TmaRowsLoad<Element, SmemLayoutQ, kBlockM, kHeadDim>;
    using TmaKV = TmaRowsLoad<Element, SmemLayoutKV, kBlockN, kHeadDim>;
    using TmaO = TmaRows<SM90_TMA_STORE, Element, SmemLayoutOStage, 64, kHeadDim>;
    static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
    static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

    // The persistent CTAs' work: units of one query block, or two (m and num_m_blocks - 1 - m, heaviest
    // first) where the mask makes blocks unequal; a head's units are consecutive, so the CTAs running
    // at once share few heads' K/V in L2. CTA c takes units c, c + gridDim.x, ...
    struct WsSchedule {
        int num_m_blocks, units_per_head, num_units;
        bool paired;

        static WsSchedule make(const AttentionParams &p, bool masked, int num_sms) {
            const int num_m = (p.seqlen_q + kBlockM - 1) / kBlockM, heads_batch = p.heads * p.batch;
            // Pairs halve the units: only where they still fill every SM.
            const bool paired = masked && num_m > 1 && int64_t((num_m + 1) / 2) * heads_batch >= num_sms;
            const int per_head = paired ? (num_m + 1) / 2 : num_m;
            return {num_m, per_head, per_head * heads_batch, paired};
        }
        // The i-th query block (i = 0, 1) of unit u, or -1.
        __device__ int m_block(int unit, int i) const {
            const int p = unit % units_per_head, heavy = num_m_blocks - 1 - p;
            return i == 0 ? heavy : (paired && p != heavy ? p : -1);
        }
        __device__ int head(int unit, int heads) const { return unit / units_per_head % heads; }
        __device__ int batch(int unit, int heads) const { return unit / units_per_head / heads; }
    };

    struct KernelArgs {
        AttentionParams params;
        TmaQ tma_q;
        TmaKV tma_k, tma_v;
        TmaO tma_o;  // meaningful where staged_o
        WsSchedule schedule;
        bool staged_o;  // kStagedO, and o TMA-storable
    };

    static KernelArgs make_args(const AttentionParams &p, bool masked, int num_sms) {
        const TmaRowsShape q_shape = q_rows_shape(p), k_shape = k_rows_shape(p);
        auto mQ = tma_rows_tensor<Element>(p.q_ptr, q_shape, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
        auto mK = tma_rows_tensor<Element>(p.k_ptr, k_shape, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
        auto mV = tma_rows_tensor<Element>(p.v_ptr, k_shape, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
        const bool staged_o = kStagedO && bulk_storable(p.o_ptr, p.o_row_stride, p.o_head_stride, p.o_batch_stride,
                                                        p.head_dim, int(sizeof(Element)));
        // O's descriptor only where it is used; else any valid one (q's) stands in.
        auto mO = staged_o
            ? tma_rows_tensor<Element>(p.o_ptr, q_shape, p.o_row_stride, p.o_head_stride, p.o_batch_stride)
            : mQ;
        return {p, make_tma_rows_load<SmemLayoutQ, kBlockM, kHeadDim>(mQ),
                make_tma_rows_load<SmemLayoutKV, kBlockN, kHeadDim>(mK),
                make_tma_rows_load<SmemLayoutKV, kBlockN, kHeadDim>(mV),
                make_tma_rows<SM90_TMA_STORE, SmemLayoutOStage, 64, kHeadDim>(mO),
                WsSchedule::make(p, masked, num_sms), staged_o};
    }

    static bool supports(const AttentionParams &p) {
        return tma_rows_cover(p) &&
               tma_loadable({p.q_ptr, p.k_ptr, p.v_ptr},
                            {p.q_row_stride, p.q_head_stride, p.q_batch_stride, p.k_row_stride, p.k_head_stride,
                             p.k_batch_stride, p.v_row_stride, p.v_head_stride, p.v_batch_stride},
                            p.head_dim, int(sizeof(Element)));
    }
};

// Keeps the wgmma wait that follows after the work that computed `value`. ptxas places a
// wgmma.wait_group as early as it can in the instruction stream, so the forward's wait for P V went
// above the softmax it was meant to run under (every overlapped kernel: the exponentials ran after
// P V had landed). It keeps a shared-memory store before a later wait; this one stores a value
// the softmax produced into a slot nobody reads.
__device__ __forceinline__ void anchor_wait_after(float value, float *slot) {
#if FLASH_WGMMA_ARCH
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(uint32_t(__cvta_generic_to_shared(slot))), "f"(value) : "memory");
#endif
}

// Overlap: each consumer issues S of key block j + 1 together with O += P V of block j, then
// exponentiates S while P V still runs (O is rescaled after it lands), and the consumers take turns
// issuing (ping-pong), so one's softmax runs while another's GEMMs do.
template <typename Ws, bool Is_masked, bool Overlap>
__global__ void __launch_bounds__(Ws::kThreads, 1)
flash_fwd_ws_kernel(const __grid_constant__ typename Ws::KernelArgs args) {
#if FLASH_WGMMA_ARCH
    using Element = typename Ws::Element;
    using Pipeline = typename Ws::Pipeline;
    using PipelineState = typename Ws::PipelineState;
    constexpr int kBlockM = Ws::kBlockM, kBlockN = Ws::kBlockN, kHeadDim = Ws::kHeadDim;
    const AttentionParams &params = args.params;

    extern __shared__ __align__(1024) char smem_raw[];
    auto &storage = *reinterpret_cast<typename Ws::SharedStorage *>(smem_raw);

    const typename Ws::WsSchedule &schedule = args.schedule;
    const int warpgroup = threadIdx.x / 128;

    // Barriers: Q's (one arrival: the producer's expect-tx), Q's release (every consumer thread),
    // and the K and V rings.
    if (threadIdx.x == 0) {
        storage.barrier_q.init(1);
        storage.barrier_q_empty.init(Ws::kConsumerThreads);
        cutlass::arch::fence_barrier_init();
    }
    typename Pipeline::Params pipe_params;
    pipe_params.transaction_bytes = Ws::kBytesKV;
    pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = threadIdx.x == 0;
    pipe_params.num_consumers = Ws::kConsumerThreads;
    Pipeline pipeline_k(storage.pipeline_k, pipe_params, Shape<_1, _1, _1>{}, cute::true_type{}, cute::true_type{});
    Pipeline pipeline_v(storage.pipeline_v, pipe_params, Shape<_1, _1, _1>{}, cute::true_type{}, cute::true_type{});
    __syncthreads();  // barriers initialised before anyone waits on them

    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Ws::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Ws::SmemLayoutKVStages{});
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Ws::SmemLayoutKVStages{});

    // Every role walks the same query blocks: those of this CTA's units that exist (varlen: a
    // sequence shorter than the longest has fewer), in order; `item` counts them (Q's phases).
    auto for_each_block = [&](auto &&body) {
        int item = 0;
        for (int unit = blockIdx.x; unit < schedule.num_units; unit += gridDim.x) {
            const int bidh = schedule.head(unit, params.heads), bidb = schedule.batch(unit, params.heads);
            const SequenceInfo seq(params, bidb);
            for (int i = 0; i < 2; ++i) {
                const int m_block = schedule.m_block(unit, i);
                if (m_block < 0 || m_block * kBlockM >= seq.seqlen_q) { continue; }
                body(seq, m_block, bidh, bidb, item++);
            }
        }
    };

    if (warpgroup == 0) {  // producer
        cutlass::arch::warpgroup_reg_dealloc<Ws::kProducerRegisters>();
        if (threadIdx.x != 0) { return; }  // the pipeline's leader (is_leader) arms the barriers it loads into
        PipelineState state = cutlass::make_producer_start_state<Pipeline>();
        for_each_block([&](const SequenceInfo &seq, int m_block, int bidh, int bidb, int item) {
            const int bidh_k = bidh / params.heads_per_head_k;
            const auto range = KeyBlockRange<kBlockM, kBlockN, Is_masked>::make(params, seq, m_block, 0);
            Tensor mQ = args.tma_q.get_tma_tensor(q_rows_shape(params));
            Tensor mK = args.tma_k.get_tma_tensor(k_rows_shape(params));
            Tensor mV = args.tma_v.get_tma_tensor(k_rows_shape(params));
            Tensor gQ = local_tile(sequence_rows(mQ, seq.q_start, bidh, bidb), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                                   make_coord(m_block, _0{}));
            Tensor gK = local_tile(sequence_rows(mK, seq.k_start, bidh_k, bidb), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                   make_coord(_, _0{}));
            Tensor gV = local_tile(sequence_rows(mV, seq.k_start, bidh_k, bidb), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                   make_coord(_, _0{}));
            auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                              group_modes<0, 2>(gQ));
            auto [tKgK, tKsK] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                              group_modes<0, 2>(gK));
            auto [tVgV, tVsV] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                              group_modes<0, 2>(gV));
            using BarrierType = typename Pipeline::ProducerBarrierType;
            // Q has one buffer: the last block's consumers must be done with it. Its first K/V stage
            // is issued before that wait, as soon as the ring has room.
            bool q_issued = false;
            auto issue_q = [&] {
                if (item > 0) { storage.barrier_q_empty.wait((item - 1) % 2); }
                storage.barrier_q.arrive_and_expect_tx(Ws::kBytesQ);
                copy(args.tma_q.with(reinterpret_cast<BarrierType &>(storage.barrier_q), 0), tQgQ, tQsQ);
                q_issued = true;
            };
            for (int n_block = range.n_block_max - 1; n_block >= range.n_block_min; --n_block) {
                pipeline_k.producer_acquire(state);
                copy(args.tma_k.with(*pipeline_k.producer_get_barrier(state), 0), tKgK(_, n_block),
                     tKsK(_, state.index()));
                pipeline_v.producer_acquire(state);
                copy(args.tma_v.with(*pipeline_v.producer_get_barrier(state), 0), tVgV(_, n_block),
                     tVsV(_, state.index()));
                ++state;
                if (!q_issued) { issue_q(); }
            }
            if (!q_issued) { issue_q(); }  // no key block to see: the consumers still wait for Q
        });
        return;
    }

    // Consumers: threads 128.., as threads 0.. of the consumer warpgroups' MMAs.
    cutlass::arch::warpgroup_reg_alloc<Ws::kConsumerRegisters>();
    const int ctid = threadIdx.x - 128;
    typename Ws::TiledMmaS tiled_mma_s;
    typename Ws::TiledMmaO tiled_mma_o;
    auto thr_s = tiled_mma_s.get_thread_slice(ctid);
    auto thr_o = tiled_mma_o.get_thread_slice(ctid);
    const int wg_thread0 = warpgroup_first_thread(ctid);  // slices the shared-memory operands
    auto wg_s = tiled_mma_s.get_thread_slice(wg_thread0);
    auto wg_o = tiled_mma_o.get_thread_slice(wg_thread0);
    Tensor tSrQ = wg_s.partition_fragment_A(smem_view(storage.q.data(), typename Ws::SmemLayoutQ{}));
    auto tSrK = [&](int stage) {
        return wg_s.partition_fragment_B(smem_view(storage.k.data() + stage * Ws::kTileElems,
                                                   typename Ws::SmemLayoutKV{}));
    };
    auto tOrV = [&](int stage) {
        return wg_o.partition_fragment_B(smem_view(storage.v.data() + stage * Ws::kTileElems,
                                                   typename Ws::SmemLayoutVt{}));
    };
    Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor tScS_rc = make_tensor(tScS.data(), acc_as_rowcol(tScS.layout()));
    Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tOcO_rc = make_tensor(tOcO.data(), acc_as_rowcol(tOcO.layout()));
    PipelineState state;  // consumers start at phase 0; the ring's state runs on across blocks
    // kStagedO first: where it is false the staged code is not compiled in (as a runtime flag alone
    // it cost the three-consumer d64 kernel 4-12%: registers).
    const bool staged_o = Ws::kStagedO && args.staged_o;
    WsStagedO staged;
    Element *o_tiles = storage.o.data() + (warpgroup - 1) * 2 * cosize_v<typename Ws::SmemLayoutOStage>;

    for_each_block([&](const SequenceInfo &seq, int m_block, int bidh, int bidb, int item) {
        const auto range = KeyBlockRange<kBlockM, kBlockN, Is_masked>::make(params, seq, m_block, 0);
        Tensor acc_o = partition_fragment_C(tiled_mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        clear(acc_o);
        Tensor acc_o_rowcol = make_tensor(acc_o.data(), acc_as_rowcol(acc_o.layout()));
        constexpr int kRows = decltype(size<0>(acc_o_rowcol))::value;
        OnlineSoftmax<kRows> softmax;
        const ScoreMods score_mods = ScoreMods::make(params, seq, bidb, bidh);

        if (staged_o) { staged.issue<Ws>(params, args.tma_o, o_tiles, warpgroup - 1, ctid % 128); }
        storage.barrier_q.wait(item % 2);
        // S = Q K^T of a key block, waited for, its K stage released, masked and exponentiated (acc_o
        // rescaled with it): acc_s then holds P. issued() runs once the product is issued.
        auto scores_to_p = [&](auto &acc_s, auto &scores, PipelineState const &stage_state, int n_block,
                               auto issued) {
            pipeline_k.consumer_wait(stage_state);
            wgmma_gemm<true>(tiled_mma_s, tSrQ, tSrK(stage_state.index()), acc_s);
            issued();
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_s);
            pipeline_k.consumer_release(stage_state);
            score_mods.apply<kBlockM, kBlockN, Is_masked>(acc_s, scores, tScS_rc, m_block, n_block, [] {});
            softmax.update(scores, acc_o_rowcol, params.score_scale_log2);
        };
        if constexpr (!Overlap) {
            for (int n_block = range.n_block_max - 1; n_block >= range.n_block_min; --n_block) {
                Tensor acc_s = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
                Tensor scores = make_tensor(acc_s.data(), acc_as_rowcol(acc_s.layout()));
                scores_to_p(acc_s, scores, state, n_block, [] {});
                Tensor rP = convert_type<Element>(acc_s);
                Tensor tOrP = make_tensor(rP.data(), acc_as_A_operand(rP.layout()));

                pipeline_v.consumer_wait(state);
                wgmma_gemm<false, true>(tiled_mma_o, tOrP, tOrV(state.index()), acc_o);
                warpgroup_wait<0>();
                warpgroup_fence_operand(acc_o);
                pipeline_v.consumer_release(state);
                ++state;
            }
        } else if (range.n_block_max > range.n_block_min) {
            // Block j's S -> P (registers, the input dtype); the loop then issues S of j + 1 with P V of j.
            const int consumer = warpgroup - 1;
            const int turns = range.n_block_max - range.n_block_min - 1;  // the same for every consumer
            int n_block = range.n_block_max - 1;
            // Every product is issued in a turn: S of the first block, then S of j + 1 with P V of j,
            // then the last P V. The first turn is consumer 0's: the last consumer opens it. Each
            // turn's end opens the next consumer's, except the last consumer's last, which no turn
            // would take (every arrival of a block is waited for within the block, so the next
            // block's turns start afresh).
            constexpr int kLast = Ws::kConsumers - 1;
            if (consumer == kLast) { ws_pass_turn<Ws::kConsumers>(consumer); }
            Tensor acc_s = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
            Tensor scores = make_tensor(acc_s.data(), acc_as_rowcol(acc_s.layout()));
            ws_wait_turn<Ws::kConsumers>(consumer);
            scores_to_p(acc_s, scores, state, n_block, [&] { ws_pass_turn<Ws::kConsumers>(consumer); });
            Tensor rP = convert_type<Element>(acc_s);
            Tensor tOrP = make_tensor(rP.data(), acc_as_A_operand(rP.layout()));
            PipelineState state_v = state;  // the stage of P's V
            ++state;
            for (int turn = 0; turn < turns; ++turn) {
                --n_block;
                ws_wait_turn<Ws::kConsumers>(consumer);
                pipeline_k.consumer_wait(state);
                wgmma_gemm<true>(tiled_mma_s, tSrQ, tSrK(state.index()), acc_s);
                pipeline_v.consumer_wait(state_v);
                wgmma_gemm<false, true>(tiled_mma_o, tOrP, tOrV(state_v.index()), acc_o);
                ws_pass_turn<Ws::kConsumers>(consumer);
                warpgroup_wait<1>();  // S of this block landed; P V of the last may still run
                warpgroup_fence_operand(acc_s);
                pipeline_k.consumer_release(state);
                score_mods.apply<kBlockM, kBlockN, Is_masked>(acc_s, scores, tScS_rc, m_block, n_block, [] {});
                float rescale[kRows];
                softmax.update_scores(scores, rescale, params.score_scale_log2);
                anchor_wait_after(softmax.row_sum[0] + softmax.row_sum[kRows - 1], &storage.wait_anchor[ctid]);
                warpgroup_wait<0>();  // P V landed: rP and the V stage are free, acc_o is final
                warpgroup_fence_operand(acc_o);
                pipeline_v.consumer_release(state_v);
                softmax.rescale_o(acc_o_rowcol, rescale);
                rP = convert_type<Element>(acc_s);
                state_v = state;
                ++state;
            }
            ws_wait_turn<Ws::kConsumers>(consumer);
            pipeline_v.consumer_wait(state_v);
            wgmma_gemm<false, true>(tiled_mma_o, tOrP, tOrV(state_v.index()), acc_o);
            if (consumer != kLast) { ws_pass_turn<Ws::kConsumers>(consumer); }
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_o);
            pipeline_v.consumer_release(state_v);
        }
        // Every S product of this block has been waited for: Q's buffer is the next block's.
        storage.barrier_q_empty.arrive();

        float lse[kRows];
        softmax.finalize(acc_o_rowcol, params.score_scale, 1.f, lse, INFINITY);
        if (staged_o) {
            staged.write<Ws>(params, seq, acc_o_rowcol, tOcO_rc, lse, m_block, bidb, bidh, o_tiles, warpgroup - 1,
                             ctid % 128);
        } else {
            ws_store_o<Ws>(params, seq, acc_o_rowcol, tOcO_rc, lse, m_block, bidb, bidh);
        }
    });
    if (staged_o) {
        staged.issue<Ws>(params, args.tma_o, o_tiles, warpgroup - 1, ctid % 128);
        if (ctid % 128 == 0) { tma_store_wait<0>(); }  // shared memory outlives the store's reads
    }
#else
    __trap();  // only sm_90a images reach here; never leave O unwritten
#endif
}

}  // namespace flash
