// The parameters of one attention launch: what the binding fills in and every kernel reads.
// Plain data only (no torch types) so that kernel translation units compile without torch.
#pragma once

#include <cstdint>
#include <utility>
#include <cuda_runtime.h>

namespace flash {

// Where the dropout random stream starts. Outside CUDA-graph capture the seed and offset are
// plain values; under capture they live in device memory that the graph updates on replay.
struct PhiloxState {
    uint64_t seed = 0;
    uint64_t offset = 0;
    const int64_t *seed_ptr = nullptr;    // set when captured
    const int64_t *offset_ptr = nullptr;  // set when captured
    uint64_t offset_intragraph = 0;
    bool captured = false;
};

struct AttentionParams {
    using index_t = int64_t;

    // Inputs, (batch, seqlen, heads, head_dim) or varlen (total, heads, head_dim). Strides in
    // elements; the last dimension is contiguous.
    void *__restrict__ q_ptr = nullptr;
    void *__restrict__ k_ptr = nullptr;
    void *__restrict__ v_ptr = nullptr;
    index_t q_batch_stride = 0, k_batch_stride = 0, v_batch_stride = 0;
    index_t q_row_stride = 0, k_row_stride = 0, v_row_stride = 0;
    index_t q_head_stride = 0, k_head_stride = 0, v_head_stride = 0;

    // Output and its log-sum-exp. softmax_lse is (batch, heads, seqlen_q), or (heads, total_q)
    // for varlen inputs.
    void *__restrict__ o_ptr = nullptr;
    index_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
    float *__restrict__ softmax_lse_ptr = nullptr;

    // S_dmask (batch, heads, seqlen_q_rounded, seqlen_k_rounded): probabilities, negated where
    // dropout dropped them. Written only when return_softmax and dropout is on.
    void *__restrict__ s_dmask_ptr = nullptr;

    int batch = 0, heads = 0, heads_k = 0, heads_per_head_k = 1;
    int seqlen_q = 0, seqlen_k = 0;  // max over the batch for varlen
    int seqlen_q_rounded = 0, seqlen_k_rounded = 0;
    int head_dim = 0;                // actual head dim (a multiple of 8), <= the kernel's
    int total_q = 0;
    int total_k = 0;  // rows of k / v (batch * seqlen_k padded, all pages when paged)

    // Varlen: cumulative offsets (batch + 1) of each sequence in the packed q/k/v.
    const int *__restrict__ cu_seqlens_q = nullptr;
    const int *__restrict__ cu_seqlens_k = nullptr;
    const int *__restrict__ seqused_k = nullptr;  // optional: keys actually used per sequence

    // Paged K/V: k/v are (num_blocks, page_block_size, heads_k, head_dim); block_table maps
    // (batch, logical page) to a physical block. page_block_size is any multiple of 16: a key
    // block may span several pages (its rows are gathered one by one).
    const int *__restrict__ block_table = nullptr;
    index_t block_table_batch_stride = 0;
    int page_block_size = 0;

    // KV cache (flash_attn_with_kvcache): batch entry b reads the cache row kv_batch_idx[b] (else
    // b) and its keys start at row leftpad_k[b] of it (else 0); seqused_k[b] is then the end of
    // its keys in the cache, so the entry has seqused_k[b] - leftpad_k[b] keys.
    const int *__restrict__ kv_batch_idx = nullptr;
    const int *__restrict__ leftpad_k = nullptr;

    // Scores. The kernel's S accumulator holds q k^T, which softcap > 0 replaces by
    // tanh(q k^T * softcap_input_scale); the score the softmax exponentiates is that accumulator
    // times score_scale: softmax_scale without softcap, softcap with it (so that score =
    // softcap * tanh(q k^T * softmax_scale / softcap)). ALiBi and the mask act on the accumulator.
    float softmax_scale = 1.f;     // the caller's scale of q k^T (the backward's dq and dk use it)
    float score_scale = 1.f;       // score = S accumulator * score_scale, natural-log units
    float score_scale_log2 = 1.f;  // score_scale * log2(e): the kernel's exp is base 2
    float softcap = 0.f;
    float softcap_input_scale = 0.f;  // softmax_scale / softcap

    // Masking. is_masked: a causal or sliding-window mask applies (window sizes below, -1 = none
    // on that side; causal is window (-1, 0)).
    bool is_masked = false;
    int window_size_left = -1, window_size_right = -1;

    // ALiBi: slope of (batch, head) at alibi_slopes_ptr[batch * batch_stride + head].
    const float *__restrict__ alibi_slopes_ptr = nullptr;
    index_t alibi_slopes_batch_stride = 0;

    // Dropout: keep an element when its 16-bit random number is below dropout_keep_threshold.
    // keep_prob is 1 - dropout_p (the API's probability of dropping); 1 = no dropout.
    float keep_prob = 1.f;
    uint32_t dropout_keep_threshold = 0;  // keep_prob * 2^16
    float inv_keep_prob = 1.f;            // 1 / keep_prob: kept weights are scaled by it
    PhiloxState philox;
    int64_t *__restrict__ rng_state = nullptr;  // (2,): the seed and offset actually used

    // Backward. dO is laid out like O; dq like q; dk/dv (batch, seqlen_k, heads, head_dim) hold
    // one gradient per query head (the binding sums a GQA group). dq accumulates in fp32 in
    // dq_accum (num_splits, heads, rows, kernel head dim) with rows = batch * seqlen_q_rounded, or
    // total_q + 128 for varlen, so that a query block is one contiguous range (the row stride is the
    // kernel head dim); softmax_d = rowsum(dO * O) is laid out like softmax_lse.
    void *__restrict__ do_ptr = nullptr;
    index_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
    void *__restrict__ dq_ptr = nullptr;
    void *__restrict__ dk_ptr = nullptr;
    void *__restrict__ dv_ptr = nullptr;
    index_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
    index_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
    index_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
    float *__restrict__ dq_accum_ptr = nullptr;
    index_t dq_accum_split_stride = 0, dq_accum_head_stride = 0, dq_accum_row_stride = 0;
    float *__restrict__ softmax_d_ptr = nullptr;
    // deterministic: num_splits CTAs per (batch, head) each walk their own key blocks and add into
    // their own dq_accum slice in a fixed order; otherwise one CTA per key block, one slice.
    // Forward (split-KV): num_splits CTAs per (query block, batch, head) each take a contiguous
    // share of its key blocks and write O normalised by their own row sums and their lse, in fp32,
    // to oaccum (num_splits, batch, heads, seqlen_q, kernel head dim) and softmax_lse_accum
    // (num_splits, batch, heads, seqlen_q); the combine kernel merges them into O and softmax_lse.
    int num_splits = 1;
    bool deterministic = false;
    float *__restrict__ oaccum_ptr = nullptr;
    float *__restrict__ softmax_lse_accum_ptr = nullptr;

    bool is_bf16 = false;
};

// Philox offsets one launch consumes per stream (what the binding reserves from the generator):
// one per lane and 16-column cell of the key axis (see dropout.h).
inline constexpr int64_t dropout_offsets_per_launch(int seqlen_k_rounded) {
    return 32 * int64_t(seqlen_k_rounded / 16);
}

// Launches the forward kernel chosen by (dtype, head dim, dropout, mask) for these params, and
// with num_splits > 1 the combine kernel after it.
void run_mha_fwd(AttentionParams &params, cudaStream_t stream);

// Launches the backward: rowsum(dO * O), the dK/dV/dQ kernel, and dq_accum -> dq.
void run_mha_bwd(AttentionParams &params, cudaStream_t stream);

// The head dim of the kernel that runs inputs of this head dim: the smallest compiled one that
// holds it, or 0 when none does.
int kernel_head_dim(int head_dim);
bool compiled_dtype(bool is_bf16);
// Key-block size of the backward kernel (the binding sizes the deterministic dq_accum by it).
int backward_block_n(int kernel_head_dim);
// (query-block, key-block) sizes of the forward kernel that runs these params (the binding
// chooses the split-KV count from them); (0, 0) when no compiled kernel holds the head dim.
std::pair<int, int> forward_block_mn(const AttentionParams &params);

}  // namespace flash
