// Where one batch entry's sequences start and how long they are, for padded and varlen inputs.
#pragma once

#include "flash.h"

namespace flash {

struct SequenceInfo {
    using index_t = int64_t;

    __device__ SequenceInfo(const AttentionParams &params, int bidb)
        : q_start(params.cu_seqlens_q == nullptr ? -1 : params.cu_seqlens_q[bidb]),
          k_start(params.cu_seqlens_k == nullptr ? -1 : params.cu_seqlens_k[bidb]),
          k_first_row(params.leftpad_k == nullptr ? 0 : params.leftpad_k[bidb]),
          kv_batch(params.kv_batch_idx == nullptr ? bidb : params.kv_batch_idx[bidb]),
          seqlen_q(params.cu_seqlens_q == nullptr ? params.seqlen_q
                                                  : params.cu_seqlens_q[bidb + 1] - q_start),
          seqlen_k((params.seqused_k != nullptr ? params.seqused_k[bidb]
                    : params.cu_seqlens_k == nullptr ? params.seqlen_k
                                                     : params.cu_seqlens_k[bidb + 1] - k_start) - k_first_row) {}

    // Element offset of this batch entry's first row (padded: batch stride; varlen: row offset).
    __device__ index_t q_offset(index_t batch_stride, index_t row_stride, int bidb) const {
        return q_start < 0 ? bidb * batch_stride : index_t(q_start) * row_stride;
    }
    // Element offset of this entry's first key (not paged): its cache row, past the left padding.
    __device__ index_t k_offset(index_t batch_stride, index_t row_stride) const {
        return (k_start < 0 ? kv_batch * batch_stride : index_t(k_start) * row_stride) +
               index_t(k_first_row) * row_stride;
    }

    const int q_start, k_start;
    const int k_first_row;  // keys start at this row of the entry's (cache) sequence
    const int kv_batch;     // the cache row this entry reads (padded layout)
    const int seqlen_q, seqlen_k;
};

// Index of (batch, head, row) in softmax_lse: (heads, total_q) for varlen inputs, else
// (batch, heads, seqlen_q); the forward writes it, the backward reads it.
__device__ __forceinline__ int64_t lse_index(const AttentionParams &params, const SequenceInfo &seq,
                                             int bidb, int bidh, int row) {
    return seq.q_start >= 0 ? int64_t(bidh) * params.total_q + seq.q_start + row
                            : (int64_t(bidb) * params.heads + bidh) * params.seqlen_q + row;
}

}  // namespace flash
