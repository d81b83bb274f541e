// The query-side (q, o, dO) and key-side (k, v) tensors of the warp-specialised kernels as their TMA
// loads see them: (rows, head dim, heads, batch entries). Varlen inputs are one batch entry of all
// the packed rows, and a sequence's tiles are offset by its first row (rows past its end are the
// next sequence's: the kernels mask them or do not store them).
#pragma once

#include <cstdint>
#include <initializer_list>

#include <cute/tensor.hpp>

#include "flash.h"

namespace flash {

using namespace cute;

using TmaRowsShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
using TmaRowsStride = cute::Stride<int64_t, _1, int64_t, int64_t>;

__host__ __device__ inline TmaRowsShape q_rows_shape(const AttentionParams &p) {
    const bool varlen = p.cu_seqlens_q != nullptr;
    return {varlen ? p.total_q : p.seqlen_q, p.head_dim, p.heads, varlen ? 1 : p.batch};
}
__host__ __device__ inline TmaRowsShape k_rows_shape(const AttentionParams &p) {
    const bool varlen = p.cu_seqlens_k != nullptr;
    return {varlen ? p.total_k : p.seqlen_k, p.head_dim, p.heads_k, varlen ? 1 : p.batch};
}

// The global tensor of the given shape (q_rows_shape / k_rows_shape) and strides; a single batch
// entry (varlen) has no batch stride.
template <typename Element>
auto tma_rows_tensor(const void *ptr, TmaRowsShape shape, int64_t row_stride, int64_t head_stride,
                     int64_t batch_stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const *>(ptr)), shape,
                       TmaRowsStride{row_stride, _1{}, head_stride, get<3>(shape) == 1 ? 0 : batch_stride});
}

// A TMA copy (CopyOp: SM90_TMA_LOAD, or SM90_TMA_STORE, which writes no row past the tensor's
// extent) of (kRows, kHeadDim) tiles between such a tensor and SmemLayout, and its type.
template <typename CopyOp, typename SmemLayout, int kRows, int kHeadDim, typename GmemTensor>
auto make_tma_rows(GmemTensor const &gmem) {
    return make_tma_copy(CopyOp{}, gmem, SmemLayout{}, Shape<Int<kRows>, Int<kHeadDim>>{}, _1{});
}
template <typename CopyOp, typename Element, typename SmemLayout, int kRows, int kHeadDim>
using TmaRows = decltype(make_tma_rows<CopyOp, SmemLayout, kRows, kHeadDim>(
    tma_rows_tensor<Element>(nullptr, TmaRowsShape{}, 0, 0, 0)));

// The loads (both kernels).
template <typename SmemLayout, int kRows, int kHeadDim, typename GmemTensor>
auto make_tma_rows_load(GmemTensor const &gmem) {
    return make_tma_rows<SM90_TMA_LOAD, SmemLayout, kRows, kHeadDim>(gmem);
}
template <typename Element, typename SmemLayout, int kRows, int kHeadDim>
using TmaRowsLoad = TmaRows<SM90_TMA_LOAD, Element, SmemLayout, kRows, kHeadDim>;

// One head's (rows, head dim) view of a sequence in a tensor from get_tma_tensor: its batch entry
// (padded inputs: first_row < 0), or the packed rows from first_row (varlen).
template <typename TmaTensor>
__device__ __forceinline__ auto sequence_rows(TmaTensor const &m, int first_row, int head, int batch) {
    return domain_offset(make_coord(first_row < 0 ? 0 : first_row, _0{}), m(_, _, head, first_row < 0 ? batch : 0));
}

// Whether the warp-specialised kernels' TMA loads read these inputs from each sequence's offset
// alone: q and k packed alike, no paged, cached (batch index, left padding) or partly used
// (seqused_k) keys, and no empty tensor (a TMA descriptor cannot have a zero dimension; the default
// kernels handle those).
inline bool tma_rows_cover(const AttentionParams &p) {
    const bool varlen = p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr;
    return (p.cu_seqlens_q == nullptr) == (p.cu_seqlens_k == nullptr) && p.seqused_k == nullptr &&
           p.leftpad_k == nullptr && p.kv_batch_idx == nullptr && p.block_table == nullptr && p.seqlen_q > 0 &&
           p.seqlen_k > 0 && (!varlen || (p.total_q > 0 && p.total_k > 0));
}

// Whether TMA can load these tensors: 16-byte aligned bases and strides (in elements of
// elem_bytes), and the head dim a whole number of 16-byte chunks.
inline bool tma_loadable(std::initializer_list<const void *> ptrs, std::initializer_list<int64_t> strides,
                         int head_dim, int elem_bytes) {
    const int64_t elems_per_16b = 16 / elem_bytes;
    for (const void *ptr : ptrs) {
        if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) { return false; }
    }
    for (int64_t stride : strides) {
        if (stride % elems_per_16b != 0) { return false; }
    }
    return head_dim % elems_per_16b == 0;
}

// Whether an output's rows can be written with bulk copies (cp.async.bulk shared -> global), which
// need the same 16-byte alignment of base, strides and row length as the TMA loads.
inline bool bulk_storable(const void *ptr, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                          int head_dim, int elem_bytes) {
    return tma_loadable({ptr}, {row_stride, head_stride, batch_stride}, head_dim, elem_bytes);
}

}  // namespace flash
