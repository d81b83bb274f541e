// Where one batch entry's sequences start and how long they are, for padded and varlen inputs.
#pragma once

#include "flash.h"

namespace flash {

struct SequenceInfo {
    using index_t = int64_t;

    __device__ SequenceInfo(const AttentionParams &params, int bidb)
        : q_start(params.cu_seqlens_q == nullptr ? -1 : params.cu_seqlens_q[bidb]),
          k_start(params.cu_seqlens_k == nullptr ? -1 : params.cu_seqlens_k[bidb]),
          seqlen_q(params.cu_seqlens_q == nullptr ? params.seqlen_q
                                                  : params.cu_seqlens_q[bidb + 1] - q_start),
          seqlen_k(params.seqused_k != nullptr ? params.seqused_k[bidb]
                   : params.cu_seqlens_k == nullptr ? params.seqlen_k
                                                    : params.cu_seqlens_k[bidb + 1] - k_start) {}

    // Element offset of this batch entry's first row (padded: batch stride; varlen: row offset).
    __device__ index_t q_offset(index_t batch_stride, index_t row_stride, int bidb) const {
        return q_start < 0 ? bidb * batch_stride : index_t(q_start) * row_stride;
    }
    __device__ index_t k_offset(index_t batch_stride, index_t row_stride, int bidb) const {
        return k_start < 0 ? bidb * batch_stride : index_t(k_start) * row_stride;
    }

    const int q_start, k_start;
    const int seqlen_q, seqlen_k;
};

}  // namespace flash
