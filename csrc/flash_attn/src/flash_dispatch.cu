// Chooses the compiled kernels for a launch: dtype, head dim (the smallest compiled one that
// holds the input's), dropout on or off and mask (causal / window) on or off.
#include <stdexcept>
#include <string>
#include <utility>
#include <type_traits>

#include <cutlass/numeric_types.h>

#include "flash.h"
#include "generated/compiled_kernels.h"
#include "tile_sizes.h"

namespace flash {

// Defined by the generated instantiation units.
template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void run_mha_fwd_(AttentionParams &params, cudaStream_t stream);
template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void run_mha_bwd_(AttentionParams &params, cudaStream_t stream);
// Defined in flash_combine.cu.
template <typename Element>
void run_combine(AttentionParams &params, cudaStream_t stream);

namespace {

#define FLASH_LIST_ENTRY(D) D,
constexpr int kCompiledHeadDims[] = {FLASH_FOR_EACH_COMPILED_HEAD_DIM(FLASH_LIST_ENTRY)};
#undef FLASH_LIST_ENTRY

// Calls run(dropout, masked) with std::bool_constant arguments for the params' dropout and mask
// (the template flags of both the forward and the backward kernels).
template <typename Run>
void with_flags(const AttentionParams &params, Run run) {
    using T = std::true_type;
    using F = std::false_type;
    if (params.keep_prob < 1.f) {
        if (params.is_masked) { run(T{}, T{}); } else { run(T{}, F{}); }
    } else {
        if (params.is_masked) { run(F{}, T{}); } else { run(F{}, F{}); }
    }
}

struct ForwardLaunch {
    AttentionParams &params;
    cudaStream_t stream;
    template <typename Element, int kHeadDim> void operator()() const {
        with_flags(params, [&](auto dropout, auto masked) {
            run_mha_fwd_<Element, kHeadDim, decltype(dropout)::value, decltype(masked)::value>(params, stream);
        });
        if (params.num_splits > 1) { run_combine<Element>(params, stream); }
    }
};

struct BackwardLaunch {
    AttentionParams &params;
    cudaStream_t stream;
    template <typename Element, int kHeadDim> void operator()() const {
        with_flags(params, [&](auto dropout, auto masked) {
            run_mha_bwd_<Element, kHeadDim, decltype(dropout)::value, decltype(masked)::value>(params, stream);
        });
    }
};

// Calls launch.template operator()<Element, kHeadDim>() for the params' dtype and head dim.
template <typename Launch>
void dispatch(AttentionParams &params, Launch launch) {
    const int head_dim = kernel_head_dim(params.head_dim);
    if (head_dim == 0) {
        throw std::runtime_error("flash_attn: no compiled kernel holds head dim " + std::to_string(params.head_dim) +
                                 " (rebuild with FLASH_ATTN_HDIMS including a larger head dim)");
    }
    if (!compiled_dtype(params.is_bf16)) {
        throw std::runtime_error(std::string("flash_attn: the ") + (params.is_bf16 ? "bf16" : "fp16") +
                                 " kernels are not compiled in this build (rebuild with FLASH_ATTN_DTYPES including it)");
    }
    auto with_dtype = [&](auto element) {
        using Element = decltype(element);
        switch (head_dim) {
#define FLASH_HEAD_DIM_CASE(D) case D: return launch.template operator()<Element, D>();
            FLASH_FOR_EACH_COMPILED_HEAD_DIM(FLASH_HEAD_DIM_CASE)
#undef FLASH_HEAD_DIM_CASE
        }
    };
#if FLASH_COMPILED_BF16
    if (params.is_bf16) { return with_dtype(cutlass::bfloat16_t{}); }
#endif
#if FLASH_COMPILED_FP16
    if (!params.is_bf16) { return with_dtype(cutlass::half_t{}); }
#endif
}

}  // namespace

int kernel_head_dim(int head_dim) {
    for (int d : kCompiledHeadDims) {
        if (d >= head_dim) { return d; }
    }
    return 0;
}

bool compiled_dtype(bool is_bf16) { return is_bf16 ? FLASH_COMPILED_BF16 : FLASH_COMPILED_FP16; }

// The tile run_mha_fwd_ (flash_fwd_launch.h) launches for these params.
std::pair<int, int> forward_block_mn(const AttentionParams &params) {
    const bool dropout = params.keep_prob < 1.f;
    switch (kernel_head_dim(params.head_dim)) {
#define FLASH_HEAD_DIM_CASE(D)                                                                      \
    case D:                                                                                         \
        if (takes_decode_tile(params.seqlen_q, dropout, params.is_masked)) {                       \
            return {DecodeTile<D>::kBlockM, DecodeTile<D>::kBlockN};                                \
        }                                                                                           \
        return {ForwardTile<D, false>::kBlockM, dropout ? ForwardTile<D, true>::kBlockN : ForwardTile<D, false>::kBlockN};
        FLASH_FOR_EACH_COMPILED_HEAD_DIM(FLASH_HEAD_DIM_CASE)
#undef FLASH_HEAD_DIM_CASE
    }
    return {0, 0};
}

int backward_block_n(int head_dim) {
    switch (head_dim) {
#define FLASH_HEAD_DIM_CASE(D) case D: return BackwardTile<D>::kBlockN;
        FLASH_FOR_EACH_COMPILED_HEAD_DIM(FLASH_HEAD_DIM_CASE)
#undef FLASH_HEAD_DIM_CASE
    }
    return 0;
}

void run_mha_fwd(AttentionParams &params, cudaStream_t stream) {
    dispatch(params, ForwardLaunch{params, stream});
}

void run_mha_bwd(AttentionParams &params, cudaStream_t stream) {
    dispatch(params, BackwardLaunch{params, stream});
}

}  // namespace flash
