// Split-KV combine: merges the num_splits partial results of the forward (fwd_epilogue.h) into O
// and softmax_lse. Per row of (batch, head, query): lse = log sum_s exp(lse_s) and
// O = sum_s exp(lse_s - lse) O_s. A row no split saw a key of (every lse_s = -inf) gets O = 0 and
// lse = +inf, as the unsplit kernel gives it.
#include <cmath>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/numeric_types.h>

#include "cuda_check.h"
#include "flash.h"
#include "generated/compiled_kernels.h"

namespace flash {
namespace {

constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float warp_max(float x) {
    for (int offset = 16; offset > 0; offset /= 2) { x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset)); }
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset /= 2) { x += __shfl_xor_sync(0xffffffffu, x, offset); }
    return x;
}

// One warp per row; each lane owns 4 consecutive columns per 128-column step (float4 reads of
// the fp32 partials). The head dim is a multiple of 8.
template <typename Element>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
flash_combine_kernel(const __grid_constant__ AttentionParams params) {
    const int rows = params.batch * params.heads * params.seqlen_q;
    const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) { return; }
    const int q = row % params.seqlen_q, bidh = (row / params.seqlen_q) % params.heads;
    const int bidb = row / (params.seqlen_q * params.heads);
    const float *lse_s = params.softmax_lse_accum_ptr + row;  // split s at lse_s[s * rows]

    float max_lse = -INFINITY;
    for (int s = lane; s < params.num_splits; s += 32) { max_lse = fmaxf(max_lse, lse_s[int64_t(s) * rows]); }
    max_lse = warp_max(max_lse);
    float sum = 0.f;
    if (max_lse != -INFINITY) {
        for (int s = lane; s < params.num_splits; s += 32) { sum += __expf(lse_s[int64_t(s) * rows] - max_lse); }
    }
    sum = warp_sum(sum);
    const bool empty = max_lse == -INFINITY;
    const float lse = empty ? INFINITY : max_lse + __logf(sum);
    if (lane == 0) { params.softmax_lse_ptr[row] = lse; }  // (batch, heads, seqlen_q): the row order

    Element *out = reinterpret_cast<Element *>(params.o_ptr) + int64_t(bidb) * params.o_batch_stride +
                   int64_t(q) * params.o_row_stride + int64_t(bidh) * params.o_head_stride;
    for (int col = lane * 4; col < params.head_dim; col += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (!empty) {
            for (int s = 0; s < params.num_splits; ++s) {
                const float lse_this = lse_s[int64_t(s) * rows];
                if (lse_this == -INFINITY) { continue; }
                const float weight = __expf(lse_this - lse);
                const float4 o = *reinterpret_cast<const float4 *>(
                    params.oaccum_ptr + (int64_t(s) * rows + row) * params.head_dim + col);
                acc.x += weight * o.x, acc.y += weight * o.y, acc.z += weight * o.z, acc.w += weight * o.w;
            }
        }
        out[col] = Element(acc.x), out[col + 1] = Element(acc.y);
        out[col + 2] = Element(acc.z), out[col + 3] = Element(acc.w);
    }
}

}  // namespace

template <typename Element>
void run_combine(AttentionParams &params, cudaStream_t stream) {
    const int rows = params.batch * params.heads * params.seqlen_q;
    const int blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    flash_combine_kernel<Element><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(params);
    check_cuda(cudaGetLastError(), "launch of the split-KV combine kernel");
}

#if FLASH_COMPILED_FP16
template void run_combine<cutlass::half_t>(AttentionParams &, cudaStream_t);
#endif
#if FLASH_COMPILED_BF16
template void run_combine<cutlass::bfloat16_t>(AttentionParams &, cudaStream_t);
#endif

}  // namespace flash
