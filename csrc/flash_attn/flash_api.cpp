// The torch binding of the attention kernels (module flash_attn_2_cuda): argument checks,
// allocation, one params struct, dispatch. The only attention file that includes torch.
//
// Who checks what. The public Python functions own argument validation: they check every
// argument first and name it in a ValueError (flash_attn/attention_checks.py, and the scalar
// options in flash_attn/attention_options.py). The checks here are only those a direct caller of
// this extension needs so that a kernel cannot read or write out of bounds: the dtype, device,
// rank, shape and stride of each tensor the kernels index, the head dim and the compiled kernels
// that hold it, and the page size of a paged cache. Option values that cannot make a kernel touch
// memory it should not (softcap, dropout_p, num_splits, ...) are not checked again here. Two
// checks beyond memory safety stay because this is where their subject lives: the window is
// normalised here and only here (set_common_params; every caller reaches it, flash-attn 2.8's
// private ops included), and entries below -1 have no meaning to it; and return_softmax needs
// dropout, since only the dropout kernels write S_dmask (flash-attn 2.8 raises this too).
#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include "src/flash.h"

namespace {

#define FLASH_CHECK(cond, ...) TORCH_CHECK(cond, "flash_attn: ", __VA_ARGS__)

constexpr int kMaxHeadDim = 256;
// Paged K/V: pages of any multiple of 16 rows (the kernels gather a key block's rows page by page).
constexpr int kPageMultiple = 16;
// Split-KV: at most this many CTAs share one (query block, batch, head).
constexpr int kMaxSplits = 128;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Every tensor argument goes through here: it must match q's dtype and device, have a
// contiguous last dimension and the given shape.
void check_like_q(const at::Tensor &t, const char *name, const at::Tensor &q, at::IntArrayRef shape) {
    FLASH_CHECK(t.scalar_type() == q.scalar_type(), name, " must have the dtype of q (", q.scalar_type(),
                "), got ", t.scalar_type());
    FLASH_CHECK(t.device() == q.device(), name, " must be on the device of q (", q.device(), "), got ", t.device());
    FLASH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
    FLASH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension, got strides ", t.strides());
}

void check_int32(const at::Tensor &t, const char *name, const at::Tensor &q, at::IntArrayRef shape) {
    FLASH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
    FLASH_CHECK(t.device() == q.device(), name, " must be on the device of q (", q.device(), "), got ", t.device());
    FLASH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
    FLASH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// q itself: dtype, device, head dim; and the GPU it runs on.
void check_q(const at::Tensor &q, int64_t rank) {
    FLASH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                "q must be float16 or bfloat16, got ", q.scalar_type());
    FLASH_CHECK(q.is_cuda(), "q must be on a CUDA device, got ", q.device());
    FLASH_CHECK(q.dim() == rank, "q must be ", rank, "-D, got shape ", q.sizes());
    FLASH_CHECK(q.stride(-1) == 1, "q must be contiguous in its last dimension, got strides ", q.strides());
    const int64_t head_dim = q.size(-1);
    FLASH_CHECK(head_dim <= kMaxHeadDim, "head dim must be at most ", kMaxHeadDim, ", got ", head_dim);
    FLASH_CHECK(head_dim % 8 == 0, "head dim must be a multiple of 8 (flash_attn_func pads it), got ", head_dim);
    const auto *props = at::cuda::getDeviceProperties(q.get_device());
    FLASH_CHECK(props->major >= 8, "needs an sm80 (Ampere) or newer GPU, got sm", props->major, props->minor);
    FLASH_CHECK(flash::compiled_dtype(q.scalar_type() == at::kBFloat16), "the ", q.scalar_type(),
                " kernels are not compiled in this build (rebuild with FLASH_ATTN_DTYPES including it)");
    FLASH_CHECK(flash::kernel_head_dim(int(head_dim)) > 0, "no compiled kernel holds head dim ", head_dim,
                " (rebuild with FLASH_ATTN_HDIMS including a larger head dim)");
}

// Strides of a (batch, seqlen, heads, head_dim), paged (num_blocks, page_block_size, heads,
// head_dim) or varlen (total, heads, head_dim) tensor; varlen tensors have no batch stride.
void set_strides(const at::Tensor &t, int64_t &batch_stride, int64_t &row_stride, int64_t &head_stride) {
    batch_stride = t.dim() == 4 ? t.stride(0) : 0;
    row_stride = t.stride(-3);
    head_stride = t.stride(-2);
}

// Everything of AttentionParams that the forward and backward entry points share: pointers and
// strides of q, k, v, out, the sizes, softmax scale / softcap, window, dropout, ALiBi.
void set_common_params(flash::AttentionParams &params, const at::Tensor &q, const at::Tensor &k,
                       const at::Tensor &v, const at::Tensor &out, const at::Tensor &softmax_lse, int batch,
                       int seqlen_q, int seqlen_k, float dropout_p, float softmax_scale, bool is_causal,
                       int window_size_left, int window_size_right, float softcap,
                       const std::optional<at::Tensor> &alibi_slopes_) {
    params.q_ptr = q.data_ptr();
    params.k_ptr = k.data_ptr();
    params.v_ptr = v.data_ptr();
    params.o_ptr = out.data_ptr();
    set_strides(q, params.q_batch_stride, params.q_row_stride, params.q_head_stride);
    set_strides(k, params.k_batch_stride, params.k_row_stride, params.k_head_stride);
    set_strides(v, params.v_batch_stride, params.v_row_stride, params.v_head_stride);
    set_strides(out, params.o_batch_stride, params.o_row_stride, params.o_head_stride);
    params.total_q = int(q.dim() == 4 ? q.size(0) * q.size(1) : q.size(0));
    params.total_k = int(k.dim() == 4 ? k.size(0) * k.size(1) : k.size(0));
    params.softmax_lse_ptr = softmax_lse.data_ptr<float>();
    params.is_bf16 = q.scalar_type() == at::kBFloat16;
    params.batch = batch;
    params.heads = int(q.size(-2));
    params.heads_k = int(k.size(-2));
    params.heads_per_head_k = params.heads / params.heads_k;
    params.head_dim = int(q.size(-1));
    params.seqlen_q = seqlen_q;
    params.seqlen_k = seqlen_k;
    params.seqlen_q_rounded = int(round_up(seqlen_q, 128));
    params.seqlen_k_rounded = int(round_up(seqlen_k, 128));

    params.softmax_scale = softmax_scale;
    if (softcap > 0.f) {
        params.softcap = softcap;
        params.softcap_input_scale = softmax_scale / softcap;
        params.score_scale = softcap;
    } else {
        params.score_scale = softmax_scale;
    }
    params.score_scale_log2 = params.score_scale * float(M_LOG2E);

    // The window's normalisation (the one place): causal is the window (-1, 0), and a side that
    // reaches past every key of every query is no bound at all, dropped so that the cheaper
    // unmasked tiles apply.
    if (is_causal) { window_size_right = 0; }
    if (window_size_left >= seqlen_k) { window_size_left = -1; }
    if (window_size_right >= seqlen_q) { window_size_right = -1; }
    FLASH_CHECK(window_size_left >= -1 && window_size_right >= -1,
                "window_size entries must be >= -1, got (", window_size_left, ", ", window_size_right, ")");
    params.window_size_left = window_size_left;
    params.window_size_right = window_size_right;
    params.is_masked = window_size_left >= 0 || window_size_right >= 0;

    params.keep_prob = 1.f - dropout_p;
    params.inv_keep_prob = 1.f / params.keep_prob;
    params.dropout_keep_threshold = uint32_t(std::lround(double(params.keep_prob) * 65536.0));

    if (alibi_slopes_.has_value()) {
        const at::Tensor &slopes = alibi_slopes_.value();
        FLASH_CHECK(slopes.scalar_type() == at::kFloat, "alibi_slopes must be float32, got ", slopes.scalar_type());
        FLASH_CHECK(slopes.device() == q.device(), "alibi_slopes must be on the device of q");
        FLASH_CHECK(slopes.stride(-1) == 1, "alibi_slopes must be contiguous in its last dimension");
        FLASH_CHECK((slopes.dim() == 1 && slopes.size(0) == params.heads) ||
                        (slopes.dim() == 2 && slopes.size(0) == batch && slopes.size(1) == params.heads),
                    "alibi_slopes must have shape (", params.heads, ") or (", batch, ", ", params.heads,
                    "), got ", slopes.sizes());
        params.alibi_slopes_ptr = slopes.data_ptr<float>();
        params.alibi_slopes_batch_stride = slopes.dim() == 2 ? slopes.stride(0) : 0;
    }
}

// Reserves this launch's Philox offsets from the generator; returns the rng_state tensor that
// the kernel fills with the seed and offset it used (the backward replays them).
at::Tensor set_dropout_rng(flash::AttentionParams &params, const at::Tensor &q,
                           const std::optional<at::Generator> &gen_) {
    auto rng_state = at::empty({2}, q.options().dtype(at::kLong));
    if (params.keep_prob < 1.f) {
        auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
            gen_, at::cuda::detail::getDefaultCUDAGenerator());
        at::PhiloxCudaState state;
        {
            std::lock_guard<std::mutex> lock(gen->mutex_);
            state = gen->philox_cuda_state(flash::dropout_offsets_per_launch(params.seqlen_k_rounded));
        }
        params.philox.captured = state.captured_;
        if (state.captured_) {
            params.philox.seed_ptr = state.seed_.ptr;
            params.philox.offset_ptr = state.offset_.ptr;
            params.philox.offset_intragraph = state.offset_intragraph_;
        } else {
            params.philox.seed = state.seed_.val;
            params.philox.offset = state.offset_.val;
        }
        params.rng_state = rng_state.data_ptr<int64_t>();
    }
    return rng_state;
}

at::Tensor make_s_dmask(flash::AttentionParams &params, const at::Tensor &q, bool return_softmax) {
    if (!return_softmax) { return at::empty({0}, q.options()); }
    // Only the dropout kernels write S_dmask (it encodes the dropout mask).
    FLASH_CHECK(params.keep_prob < 1.f, "return_softmax needs dropout_p > 0 (S_dmask encodes the dropout mask)");
    auto s_dmask = at::zeros({params.batch, params.heads, params.seqlen_q_rounded, params.seqlen_k_rounded},
                             q.options());
    params.s_dmask_ptr = s_dmask.data_ptr();
    return s_dmask;
}

at::Tensor out_or_new(const std::optional<at::Tensor> &out_, const at::Tensor &q) {
    if (!out_.has_value()) { return at::empty_like(q); }
    check_like_q(out_.value(), "out", q, q.sizes());
    return out_.value();
}

void check_heads(const at::Tensor &q, const at::Tensor &k) {
    FLASH_CHECK(q.size(-2) % k.size(-2) == 0, "the number of heads of k (", k.size(-2),
                ") must divide the number of heads of q (", q.size(-2), ")");
}

// The inputs of the padded entry points: q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k,
// heads_k, d).
void check_padded_inputs(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v) {
    check_q(q, 4);
    FLASH_CHECK(k.dim() == 4, "k must be 4-D (batch, seqlen_k, heads_k, head_dim), got shape ", k.sizes());
    check_like_q(k, "k", q, {q.size(0), k.size(1), k.size(2), q.size(3)});
    check_like_q(v, "v", q, k.sizes());
    check_heads(q, k);
}

// The inputs of the varlen entry points: q (total_q, heads, d), k/v (total_k, heads_k, d) or,
// paged, (num_blocks, page_block_size, heads_k, d); cu_seqlens (batch + 1). Returns the batch size.
int64_t check_varlen_inputs(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                            const at::Tensor &cu_seqlens_q, const at::Tensor &cu_seqlens_k, bool paged) {
    check_q(q, 3);
    const int64_t batch = cu_seqlens_q.numel() - 1;
    FLASH_CHECK(batch >= 0, "cu_seqlens_q must have batch + 1 >= 1 entries");
    check_int32(cu_seqlens_q, "cu_seqlens_q", q, {batch + 1});
    check_int32(cu_seqlens_k, "cu_seqlens_k", q, {batch + 1});
    if (paged) {
        FLASH_CHECK(k.dim() == 4, "k must be 4-D (num_blocks, page_block_size, heads_k, head_dim) with "
                    "block_table, got shape ", k.sizes());
        check_like_q(k, "k", q, {k.size(0), k.size(1), k.size(2), q.size(2)});
        FLASH_CHECK(k.size(1) > 0 && k.size(1) % kPageMultiple == 0, "the page_block_size of a paged k/v "
                    "(k.size(1)) must be a positive multiple of ", kPageMultiple, ", got ", k.size(1));
    } else {
        FLASH_CHECK(k.dim() == 3, "k must be 3-D (total_k, heads_k, head_dim), got shape ", k.sizes());
        check_like_q(k, "k", q, {k.size(0), k.size(1), q.size(2)});
    }
    check_like_q(v, "v", q, k.sizes());
    check_heads(q, k);
    return batch;
}

// The backward's extra inputs: out and dout like q, and the forward's log-sum-exp.
void check_backward_inputs(const at::Tensor &q, const at::Tensor &out, const at::Tensor &dout,
                           const at::Tensor &softmax_lse, at::IntArrayRef lse_shape) {
    check_like_q(out, "out", q, q.sizes());
    check_like_q(dout, "dout", q, q.sizes());
    FLASH_CHECK(softmax_lse.scalar_type() == at::kFloat && softmax_lse.sizes() == lse_shape &&
                    softmax_lse.is_contiguous(),
                "softmax_lse must be the forward's contiguous float32 tensor of shape ", lse_shape, ", got ",
                softmax_lse.scalar_type(), " ", softmax_lse.sizes());
}

// q (b, s_q, h, d), k/v (b, s_k, h_k, d) -> out, softmax_lse (b, h, s_q), S_dmask, rng_state.
std::vector<at::Tensor> mha_fwd(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                std::optional<at::Tensor> out_, std::optional<at::Tensor> alibi_slopes_,
                                double dropout_p, double softmax_scale, bool is_causal,
                                int64_t window_size_left, int64_t window_size_right, double softcap,
                                bool return_softmax, std::optional<at::Generator> gen_) {
    check_padded_inputs(q, k, v);
    const int64_t batch = q.size(0), seqlen_q = q.size(1), heads = q.size(2), seqlen_k = k.size(1);
    at::cuda::CUDAGuard device_guard{q.device()};

    at::Tensor out = out_or_new(out_, q);
    auto softmax_lse = at::empty({batch, heads, seqlen_q}, q.options().dtype(at::kFloat));
    flash::AttentionParams params;
    set_common_params(params, q, k, v, out, softmax_lse, int(batch), int(seqlen_q), int(seqlen_k),
                      float(dropout_p), float(softmax_scale), is_causal, int(window_size_left),
                      int(window_size_right), float(softcap), alibi_slopes_);
    at::Tensor s_dmask = make_s_dmask(params, q, return_softmax);
    at::Tensor rng_state = set_dropout_rng(params, q, gen_);

    if (out.numel() > 0) { flash::run_mha_fwd(params, at::cuda::getCurrentCUDAStream().stream()); }
    return {out, softmax_lse, s_dmask, rng_state};
}

// q (total_q, h, d); k/v (total_k, h_k, d), or paged (num_blocks, page_block_size, h_k, d) with
// block_table (b, max_blocks); cu_seqlens_q/k (b + 1) -> out, softmax_lse (h, total_q), S_dmask,
// rng_state.
std::vector<at::Tensor> mha_varlen_fwd(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, std::optional<at::Tensor> out_,
    const at::Tensor &cu_seqlens_q, const at::Tensor &cu_seqlens_k, std::optional<at::Tensor> seqused_k_,
    std::optional<at::Tensor> leftpad_k_, std::optional<at::Tensor> block_table_,
    std::optional<at::Tensor> alibi_slopes_, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
    double softmax_scale, bool zero_tensors, bool is_causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, bool return_softmax, std::optional<at::Generator> gen_) {
    const bool paged = block_table_.has_value();
    const int64_t batch = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, paged);
    const int64_t total_q = q.size(0), heads = q.size(1);
    FLASH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, "max_seqlen_q and max_seqlen_k must be >= 0");
    if (paged) { check_int32(block_table_.value(), "block_table", q, {batch, block_table_->size(-1)}); }
    if (seqused_k_.has_value()) { check_int32(seqused_k_.value(), "seqused_k", q, {batch}); }
    if (leftpad_k_.has_value()) { check_int32(leftpad_k_.value(), "leftpad_k", q, {batch}); }
    at::cuda::CUDAGuard device_guard{q.device()};

    at::Tensor out = out_or_new(out_, q);
    auto softmax_lse = at::empty({heads, total_q}, q.options().dtype(at::kFloat));
    flash::AttentionParams params;
    set_common_params(params, q, k, v, out, softmax_lse, int(batch), int(max_seqlen_q), int(max_seqlen_k),
                      float(dropout_p), float(softmax_scale), is_causal, int(window_size_left),
                      int(window_size_right), float(softcap), alibi_slopes_);
    if (paged) {
        params.block_table = block_table_->data_ptr<int>();
        params.block_table_batch_stride = block_table_->stride(0);
        params.page_block_size = int(k.size(1));
    }
    params.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
    params.cu_seqlens_k = cu_seqlens_k.data_ptr<int>();
    params.seqused_k = seqused_k_.has_value() ? seqused_k_->data_ptr<int>() : nullptr;
    params.leftpad_k = leftpad_k_.has_value() ? leftpad_k_->data_ptr<int>() : nullptr;
    at::Tensor s_dmask = make_s_dmask(params, q, return_softmax);
    at::Tensor rng_state = set_dropout_rng(params, q, gen_);

    if (zero_tensors) {
        out.zero_();
        softmax_lse.fill_(-std::numeric_limits<float>::infinity());
    }
    if (total_q > 0 && batch > 0 && max_seqlen_q > 0) {
        flash::run_mha_fwd(params, at::cuda::getCurrentCUDAStream().stream());
    }
    return {out, softmax_lse, s_dmask, rng_state};
}

// How many CTAs share the key range of one (query block, batch, head). Two forward CTAs fit an SM
// (registers) up to head dim 128, and a decode step is bound by memory: the grid should fill
// those slots. 1 when the unsplit grid already does; else the fewest splits whose last wave is
// at least 95% as full as the best count's (a split costs only its partial O: an idle slot costs
// its share of the bandwidth).
int choose_num_splits(int64_t ctas, int sms, int n_blocks) {
    const int slots = 2 * sms;
    if (ctas >= int64_t(0.8 * slots) || n_blocks <= 1) { return 1; }
    const int max_splits = std::min(kMaxSplits, n_blocks);
    auto wave_fill = [&](int splits) {
        const double waves = double(ctas * splits) / slots;
        return waves / std::ceil(waves);
    };
    double best = 0.0;
    for (int s = 1; s <= max_splits; ++s) { best = std::max(best, wave_fill(s)); }
    for (int s = 1; s <= max_splits; ++s) {
        if (wave_fill(s) >= 0.95 * best) { return s; }
    }
    return 1;
}

// flash_attn_with_kvcache's attention (the new keys are already in the cache, rotated): q (b, s_q,
// h, d) against each entry's keys [leftpad_k[b], seqlens_k[b]) of its cache row, k/v caches
// (b_cache, s_cache, h_k, d) or paged (num_blocks, page_block_size, h_k, d) with block_table
// (b, max_blocks). num_splits 0 = chosen here. -> out, softmax_lse (b, h, s_q).
std::vector<at::Tensor> mha_fwd_kvcache(
    const at::Tensor &q, const at::Tensor &kcache, const at::Tensor &vcache, const at::Tensor &seqlens_k,
    std::optional<at::Tensor> kv_batch_idx_, std::optional<at::Tensor> leftpad_k_,
    std::optional<at::Tensor> block_table_, std::optional<at::Tensor> alibi_slopes_,
    std::optional<at::Tensor> out_, double softmax_scale, bool is_causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, int64_t num_splits) {
    check_q(q, 4);
    const bool paged = block_table_.has_value();
    const int64_t batch = q.size(0), seqlen_q = q.size(1), heads = q.size(2);
    FLASH_CHECK(kcache.dim() == 4, "k_cache must be 4-D, got shape ", kcache.sizes());
    check_like_q(kcache, "k_cache", q, {kcache.size(0), kcache.size(1), kcache.size(2), q.size(3)});
    check_like_q(vcache, "v_cache", q, kcache.sizes());
    check_heads(q, kcache);
    check_int32(seqlens_k, "cache_seqlens", q, {batch});
    int64_t seqlen_k = kcache.size(1);
    if (paged) {
        check_int32(block_table_.value(), "block_table", q, {batch, block_table_->size(1)});
        FLASH_CHECK(kcache.size(1) % kPageMultiple == 0, "the page_block_size of a paged k_cache (k_cache.size(1)) "
                    "must be a multiple of ", kPageMultiple, ", got ", kcache.size(1));
        seqlen_k = block_table_->size(1) * kcache.size(1);
    } else if (!kv_batch_idx_.has_value()) {
        FLASH_CHECK(kcache.size(0) >= batch, "k_cache must have at least the ", batch, " rows of q's batch, got ",
                    kcache.size(0));
    }
    if (kv_batch_idx_.has_value()) { check_int32(kv_batch_idx_.value(), "cache_batch_idx", q, {batch}); }
    if (leftpad_k_.has_value()) { check_int32(leftpad_k_.value(), "cache_leftpad", q, {batch}); }
    at::cuda::CUDAGuard device_guard{q.device()};

    at::Tensor out = out_or_new(out_, q);
    auto softmax_lse = at::empty({batch, heads, seqlen_q}, q.options().dtype(at::kFloat));
    flash::AttentionParams params;
    set_common_params(params, q, kcache, vcache, out, softmax_lse, int(batch), int(seqlen_q), int(seqlen_k),
                      0.f, float(softmax_scale), is_causal, int(window_size_left), int(window_size_right),
                      float(softcap), alibi_slopes_);
    params.seqused_k = seqlens_k.data_ptr<int>();
    if (kv_batch_idx_.has_value()) { params.kv_batch_idx = kv_batch_idx_->data_ptr<int>(); }
    if (leftpad_k_.has_value()) { params.leftpad_k = leftpad_k_->data_ptr<int>(); }
    if (paged) {
        params.block_table = block_table_->data_ptr<int>();
        params.block_table_batch_stride = block_table_->stride(0);
        params.page_block_size = int(kcache.size(1));
    }

    const auto [block_m, block_n] = flash::forward_block_mn(params);
    const int sms = at::cuda::getDeviceProperties(q.get_device())->multiProcessorCount;
    const int64_t ctas = batch * heads * ((seqlen_q + block_m - 1) / block_m);
    const int n_blocks = int((seqlen_k + block_n - 1) / block_n);
    params.num_splits = num_splits > 0 ? int(std::min<int64_t>({num_splits, kMaxSplits, std::max(n_blocks, 1)}))
                                       : choose_num_splits(ctas, sms, n_blocks);
    at::Tensor oaccum, lse_accum;
    if (params.num_splits > 1) {
        oaccum = at::empty({params.num_splits, batch, heads, seqlen_q, params.head_dim}, q.options().dtype(at::kFloat));
        lse_accum = at::empty({params.num_splits, batch, heads, seqlen_q}, q.options().dtype(at::kFloat));
        params.oaccum_ptr = oaccum.data_ptr<float>();
        params.softmax_lse_accum_ptr = lse_accum.data_ptr<float>();
    }
    if (out.numel() > 0) { flash::run_mha_fwd(params, at::cuda::getCurrentCUDAStream().stream()); }
    return {out, softmax_lse};
}

// ---- backward ---------------------------------------------------------------------------------

// The gradient buffers of the backward: dq/dk/dv given by the caller or new; dk/dv per query head
// when GQA groups them (summed after the kernel); the fp32 dq accumulator; softmax_d.
struct BackwardBuffers {
    at::Tensor dq, dk, dv, dk_expanded, dv_expanded, dq_accum, softmax_d;
};

at::Tensor grad_or_new(const std::optional<at::Tensor> &grad_, const char *name, const at::Tensor &like) {
    if (!grad_.has_value()) { return at::empty_like(like); }
    check_like_q(grad_.value(), name, like, like.sizes());
    return grad_.value();
}

// Fills the backward part of params: dO, the gradients, the dq accumulator and its splits, and
// the dropout stream replayed from the forward's rng_state.
void set_backward_params(flash::AttentionParams &params, const at::Tensor &q, const at::Tensor &dout,
                         BackwardBuffers &buf, const at::Tensor &rng_state, bool deterministic,
                         int64_t accum_rows) {
    params.do_ptr = dout.data_ptr();
    params.dq_ptr = buf.dq.data_ptr();
    params.dk_ptr = buf.dk_expanded.data_ptr();
    params.dv_ptr = buf.dv_expanded.data_ptr();
    params.softmax_d_ptr = buf.softmax_d.data_ptr<float>();
    // Deterministic: about one CTA per SM in all, each walking its own key blocks into its own
    // dq_accum split; the splits are summed in a fixed order.
    const int kernel_head_dim = flash::kernel_head_dim(params.head_dim);
    const int n_blocks = int((params.seqlen_k + flash::backward_block_n(kernel_head_dim) - 1) /
                             flash::backward_block_n(kernel_head_dim));
    const int sms = at::cuda::getDeviceProperties(q.get_device())->multiProcessorCount;
    params.deterministic = deterministic;
    params.num_splits = deterministic ? std::max(1, std::min(n_blocks, (sms + params.batch * params.heads - 1) /
                                                                          std::max(1, params.batch * params.heads)))
                                      : 1;
    // (splits, heads, rows, kernel head dim): a query block's rows are contiguous (see flash.h).
    // The rowsum(dO * O) kernel zeroes the rows of real tokens; the padding rows only ever receive
    // added zeros and are never read.
    buf.dq_accum = at::empty({params.num_splits, params.heads, accum_rows, kernel_head_dim},
                             q.options().dtype(at::kFloat));
    params.dq_accum_ptr = buf.dq_accum.data_ptr<float>();
    params.dq_accum_split_stride = buf.dq_accum.stride(0);
    params.dq_accum_head_stride = buf.dq_accum.stride(1);
    params.dq_accum_row_stride = buf.dq_accum.stride(2);
    if (params.keep_prob < 1.f) {
        FLASH_CHECK(rng_state.numel() == 2 && rng_state.scalar_type() == at::kLong && rng_state.device() == q.device(),
                    "rng_state must be the (2,) int64 tensor the forward returned, got ", rng_state.sizes(), " ",
                    rng_state.scalar_type());
        // The forward wrote its seed and offset there; the kernel reads them back.
        params.philox.captured = true;
        params.philox.seed_ptr = rng_state.data_ptr<int64_t>();
        params.philox.offset_ptr = rng_state.data_ptr<int64_t>() + 1;
        params.philox.offset_intragraph = 0;
    }
}

// Sums the per-query-head dk/dv of each GQA group into dk/dv.
void reduce_gqa_groups(BackwardBuffers &buf, int64_t heads_k) {
    if (buf.dk_expanded.is_same(buf.dk)) { return; }
    auto sizes = buf.dk_expanded.sizes().vec();  // (..., heads, head_dim)
    const int64_t group = sizes[sizes.size() - 2] / heads_k;
    sizes[sizes.size() - 2] = heads_k;
    sizes.insert(sizes.end() - 1, group);
    at::sum_out(buf.dk, buf.dk_expanded.view(sizes), {int64_t(sizes.size()) - 2});
    at::sum_out(buf.dv, buf.dv_expanded.view(sizes), {int64_t(sizes.size()) - 2});
}

BackwardBuffers make_backward_buffers(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                      const std::optional<at::Tensor> &dq_, const std::optional<at::Tensor> &dk_,
                                      const std::optional<at::Tensor> &dv_, at::IntArrayRef lse_shape) {
    BackwardBuffers buf;
    buf.dq = grad_or_new(dq_, "dq", q);
    buf.dk = grad_or_new(dk_, "dk", k);
    buf.dv = grad_or_new(dv_, "dv", v);
    const bool grouped = q.size(-2) != k.size(-2);
    auto expanded_shape = k.sizes().vec();
    expanded_shape[expanded_shape.size() - 2] = q.size(-2);
    buf.dk_expanded = grouped ? at::empty(expanded_shape, k.options()) : buf.dk;
    buf.dv_expanded = grouped ? at::empty(expanded_shape, v.options()) : buf.dv;
    buf.softmax_d = at::empty(lse_shape, q.options().dtype(at::kFloat));
    return buf;
}

void set_grad_strides(flash::AttentionParams &params, const BackwardBuffers &buf, const at::Tensor &dout) {
    set_strides(dout, params.do_batch_stride, params.do_row_stride, params.do_head_stride);
    set_strides(buf.dq, params.dq_batch_stride, params.dq_row_stride, params.dq_head_stride);
    set_strides(buf.dk_expanded, params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride);
    set_strides(buf.dv_expanded, params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride);
}

// dout, q, k, v, out (b, s, h, d), softmax_lse (b, h, s_q) -> dq, dk, dv, softmax_d (b, h, s_q).
std::vector<at::Tensor> mha_bwd(const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k,
                                const at::Tensor &v, const at::Tensor &out, const at::Tensor &softmax_lse,
                                std::optional<at::Tensor> dq_, std::optional<at::Tensor> dk_,
                                std::optional<at::Tensor> dv_, std::optional<at::Tensor> alibi_slopes_,
                                double dropout_p, double softmax_scale, bool is_causal, int64_t window_size_left,
                                int64_t window_size_right, double softcap, bool deterministic,
                                std::optional<at::Generator> gen_, std::optional<at::Tensor> rng_state_) {
    check_padded_inputs(q, k, v);
    const int64_t batch = q.size(0), seqlen_q = q.size(1), heads = q.size(2);
    const int64_t seqlen_k = k.size(1), heads_k = k.size(2);
    check_backward_inputs(q, out, dout, softmax_lse, {batch, heads, seqlen_q});
    at::cuda::CUDAGuard device_guard{q.device()};
    (void)gen_;  // the dropout stream is replayed from rng_state

    BackwardBuffers buf = make_backward_buffers(q, k, v, dq_, dk_, dv_, {batch, heads, seqlen_q});
    flash::AttentionParams params;
    set_common_params(params, q, k, v, out, softmax_lse, int(batch), int(seqlen_q), int(seqlen_k),
                      float(dropout_p), float(softmax_scale), is_causal, int(window_size_left),
                      int(window_size_right), float(softcap), alibi_slopes_);
    set_grad_strides(params, buf, dout);
    set_backward_params(params, q, dout, buf, rng_state_.value_or(at::Tensor()), deterministic,
                        batch * round_up(seqlen_q, 128));

    if (q.numel() > 0 && seqlen_k > 0) {
        flash::run_mha_bwd(params, at::cuda::getCurrentCUDAStream().stream());
        reduce_gqa_groups(buf, heads_k);
    } else {
        buf.dq.zero_(), buf.dk.zero_(), buf.dv.zero_(), buf.softmax_d.zero_();
    }
    return {buf.dq, buf.dk, buf.dv, buf.softmax_d};
}

// The varlen form: q/dout/out (total_q, h, d), k/v (total_k, h_k, d), softmax_lse (h, total_q).
std::vector<at::Tensor> mha_varlen_bwd(
    const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &out,
    const at::Tensor &softmax_lse, std::optional<at::Tensor> dq_, std::optional<at::Tensor> dk_,
    std::optional<at::Tensor> dv_, const at::Tensor &cu_seqlens_q, const at::Tensor &cu_seqlens_k,
    std::optional<at::Tensor> alibi_slopes_, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
    double softmax_scale, bool zero_tensors, bool is_causal, int64_t window_size_left, int64_t window_size_right,
    double softcap, bool deterministic, std::optional<at::Generator> gen_, std::optional<at::Tensor> rng_state_) {
    const int64_t batch = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, false);
    const int64_t total_q = q.size(0), heads = q.size(1), heads_k = k.size(1);
    check_backward_inputs(q, out, dout, softmax_lse, {heads, total_q});
    at::cuda::CUDAGuard device_guard{q.device()};
    (void)gen_;

    BackwardBuffers buf = make_backward_buffers(q, k, v, dq_, dk_, dv_, {heads, total_q});
    if (zero_tensors) { buf.dq.zero_(), buf.dk.zero_(), buf.dv.zero_(); }
    flash::AttentionParams params;
    set_common_params(params, q, k, v, out, softmax_lse, int(batch), int(max_seqlen_q), int(max_seqlen_k),
                      float(dropout_p), float(softmax_scale), is_causal, int(window_size_left),
                      int(window_size_right), float(softcap), alibi_slopes_);
    params.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
    params.cu_seqlens_k = cu_seqlens_k.data_ptr<int>();
    set_grad_strides(params, buf, dout);
    // Rows past a sequence's end in its last query block spill into the next sequence's rows (or
    // 128 spare rows at the end) and only ever add exact zeros there.
    set_backward_params(params, q, dout, buf, rng_state_.value_or(at::Tensor()), deterministic, total_q + 128);

    if (total_q > 0 && batch > 0 && max_seqlen_q > 0 && max_seqlen_k > 0) {
        flash::run_mha_bwd(params, at::cuda::getCurrentCUDAStream().stream());
        reduce_gqa_groups(buf, heads_k);
    } else {
        buf.dq.zero_(), buf.dk.zero_(), buf.dv.zero_(), buf.softmax_d.zero_();
    }
    return {buf.dq, buf.dk, buf.dv, buf.softmax_d};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "flash_attn: exact tiled attention kernels (CUDA)";
    m.def("fwd", &mha_fwd, "Attention forward, (batch, seqlen, heads, head_dim) inputs");
    m.def("varlen_fwd", &mha_varlen_fwd, "Attention forward, variable-length (total, heads, head_dim) inputs");
    m.def("fwd_kvcache", &mha_fwd_kvcache, "Attention forward over a (paged) KV cache, with split-KV");
    m.def("kernel_head_dim", &flash::kernel_head_dim,
          "The head dim of the compiled kernel that runs inputs of this head dim (0: none)");
    m.def("bwd", &mha_bwd, "Attention backward, (batch, seqlen, heads, head_dim) inputs");
    m.def("varlen_bwd", &mha_varlen_bwd, "Attention backward, variable-length (total, heads, head_dim) inputs");
}
