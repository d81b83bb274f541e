// Chooses the compiled forward kernel for a launch: dtype, head dim (the smallest compiled one
// that holds the input's), dropout on or off, mask (causal / window) on or off.
#include <stdexcept>
#include <string>

#include <cutlass/numeric_types.h>

#include "flash.h"
#include "generated/compiled_kernels.h"

namespace flash {

// Defined by the generated instantiation units.
template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void run_mha_fwd_(AttentionParams &params, cudaStream_t stream);

namespace {

#define FLASH_LIST_ENTRY(D) D,
constexpr int kCompiledHeadDims[] = {FLASH_FOR_EACH_COMPILED_HEAD_DIM(FLASH_LIST_ENTRY)};
#undef FLASH_LIST_ENTRY

template <typename Element, int kHeadDim>
void run_with_flags(AttentionParams &params, cudaStream_t stream) {
    const bool dropout = params.p_dropout < 1.f;
    if (dropout) {
        if (params.is_masked) { run_mha_fwd_<Element, kHeadDim, true, true>(params, stream); }
        else { run_mha_fwd_<Element, kHeadDim, true, false>(params, stream); }
    } else {
        if (params.is_masked) { run_mha_fwd_<Element, kHeadDim, false, true>(params, stream); }
        else { run_mha_fwd_<Element, kHeadDim, false, false>(params, stream); }
    }
}

template <typename Element>
void run_with_head_dim(AttentionParams &params, cudaStream_t stream, int kernel_head_dim) {
    switch (kernel_head_dim) {
#define FLASH_HEAD_DIM_CASE(D) case D: return run_with_flags<Element, D>(params, stream);
        FLASH_FOR_EACH_COMPILED_HEAD_DIM(FLASH_HEAD_DIM_CASE)
#undef FLASH_HEAD_DIM_CASE
    }
    throw std::runtime_error("flash_attn: internal error: no kernel for head dim " + std::to_string(kernel_head_dim));
}

}  // namespace

int num_compiled_head_dims() { return int(sizeof(kCompiledHeadDims) / sizeof(int)); }
int compiled_head_dim(int i) { return kCompiledHeadDims[i]; }
bool compiled_dtype(bool is_bf16) { return is_bf16 ? FLASH_COMPILED_BF16 : FLASH_COMPILED_FP16; }

void run_mha_fwd(AttentionParams &params, cudaStream_t stream) {
    int kernel_head_dim = 0;
    for (int d : kCompiledHeadDims) {
        if (d >= params.head_dim) { kernel_head_dim = d; break; }
    }
    if (kernel_head_dim == 0) {
        throw std::runtime_error("flash_attn: no compiled kernel holds head dim " + std::to_string(params.head_dim) +
                                 " (rebuild with FLASH_ATTN_HDIMS including a larger head dim)");
    }
    if (params.is_bf16) {
#if FLASH_COMPILED_BF16
        return run_with_head_dim<cutlass::bfloat16_t>(params, stream, kernel_head_dim);
#endif
    } else {
#if FLASH_COMPILED_FP16
        return run_with_head_dim<cutlass::half_t>(params, stream, kernel_head_dim);
#endif
    }
    throw std::runtime_error(std::string("flash_attn: the ") + (params.is_bf16 ? "bf16" : "fp16") +
                             " kernels are not compiled in this build (rebuild with FLASH_ATTN_DTYPES including it)");
}

}  // namespace flash
