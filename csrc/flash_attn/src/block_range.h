// Which blocks a CTA walks under the mask (causal / window bound them): the forward's key blocks
// of a query block (with split-KV, the contiguous share of its split), and the backward's query
// blocks of a key block (the same window read backwards).
#pragma once

#include <algorithm>
#include <cstdint>

#include "flash.h"
#include "sequence_info.h"
#include "utils.h"

namespace flash {

template <int kBlockM, int kBlockN, bool Is_masked>
struct KeyBlockRange {
    int n_block_min, n_block_max;  // [min, max)

    __device__ static KeyBlockRange make(const AttentionParams &params, const SequenceInfo &seq, int m_block,
                                         int split) {
        const int diag = seq.seqlen_k - seq.seqlen_q;
        int lo = 0, hi = ceil_div(max(seq.seqlen_k, 0), kBlockN);
        if constexpr (Is_masked) {
            if (params.window_size_right >= 0) {
                hi = min(hi, ceil_div((m_block + 1) * kBlockM + diag + params.window_size_right, kBlockN));
            }
            if (params.window_size_left >= 0) {
                lo = max(0, (m_block * kBlockM + diag - params.window_size_left) / kBlockN);
            }
        }
        if (params.num_splits > 1) {
            const int per_split = ceil_div(max(hi - lo, 0), params.num_splits);
            lo += split * per_split;
            hi = min(hi, lo + per_split);
        }
        return {lo, hi};
    }

    __device__ bool empty() const { return n_block_max <= n_block_min; }
};

// The backward's CTAs: a 1-D grid of (sequence x head) x key splits, a sequence and head's splits
// adjacent (bwd_grid_size); a CTA walks key blocks split, + splits, ... (one each unless
// deterministic: then about one CTA per SM, each adding into its own dq_accum split, dq_split). CTAs that run
// together share a few heads' Q, dO and dq_accum rows in L2: with heads varying fastest, one wave
// of short-sequence CTAs spanned 132 heads' rows, more than the L2 holds (the H200's DRAM was half
// busy at s1k). A head's first key blocks, the heaviest under a causal mask, start first.
struct BackwardCta {
    int bidb, bidh, split, splits, dq_split;

    __device__ static BackwardCta make(const AttentionParams &params) {
        const int splits = int(gridDim.x / unsigned(params.batch * params.heads));
        const int head_seq = int(blockIdx.x) / splits, split = int(blockIdx.x) % splits;
        return {head_seq / params.heads, head_seq % params.heads, split, splits, params.deterministic ? split : 0};
    }
};

// Its grid size for a key length of n_blocks blocks: a split per key block (num_splits when
// deterministic) per sequence and head, fewer where the product would pass CUDA's limit on
// gridDim.x (the CTAs then walk more key blocks).
inline unsigned bwd_grid_size(const AttentionParams &params, int n_blocks) {
    const int key_splits = params.deterministic ? params.num_splits : n_blocks;
    const int64_t head_seqs = int64_t(params.batch) * params.heads;
    const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(key_splits, 0x7fffffff / head_seqs));
    return unsigned(head_seqs * splits);
}

template <int kBlockM, int kBlockN, bool Is_masked>
struct QueryBlockRange {
    int m_block_min, m_block_max;  // [min, max)

    __device__ __forceinline__ static QueryBlockRange make(const AttentionParams &params, const SequenceInfo &seq,
                                                           int n_block) {
        const int diag = seq.seqlen_k - seq.seqlen_q;
        int lo = 0, hi = ceil_div(seq.seqlen_q, kBlockM);
        if constexpr (Is_masked) {
            if (params.window_size_right >= 0) {
                const int first_row = n_block * kBlockN - diag - params.window_size_right;
                lo = max(0, first_row >= 0 ? first_row / kBlockM : 0);
            }
            if (params.window_size_left >= 0) {
                const int last_row = (n_block + 1) * kBlockN - 1 - diag + params.window_size_left;
                hi = min(hi, last_row >= 0 ? last_row / kBlockM + 1 : 0);
            }
        }
        return {lo, hi};
    }

    __device__ bool empty() const { return m_block_max <= m_block_min; }
};

}  // namespace flash
