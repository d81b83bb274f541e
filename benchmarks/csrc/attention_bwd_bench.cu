// Times the attention forward and backward kernels without PyTorch: a tuning harness that links
// against the generated kernel units of any source tree, so that several kernel variants compiled
// here can be timed in one short GPU session. Reports TFLOP/s of the forward and of the backward
// (2.5x the forward's FLOPs), inputs laid out (batch, seqlen, heads, head_dim) as
// benchmark_flash_attention.py uses them.
//
//   scripts/build_bwd_bench.sh SRC_DIR OUT_BINARY   (compiles the units + this file)
//   OUT_BINARY [head_dim ...]                       (64 and/or 128, 256 if built; default 64 128)
//   OUT_BINARY --one HEAD_DIM SEQLEN [causal]       (one case, non-causal unless named, e.g. under
//                                                   ncu; FLASH_BENCH_REPS=1 for a sanitizer)
// At seqlen 1024 the o, dq, dk, dv of (batch 0, head 0) are also checked against a plain fp32 reference.
// FLASH_BENCH_FWD_ONLY=1: the backward runs only where the check needs it (seqlen 1024).
#include <algorithm>
#include <iterator>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include "flash.h"

// Defined by the generated instantiation units (only the no-dropout ones are linked).
namespace flash {
template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void run_mha_fwd_(AttentionParams &params, cudaStream_t stream);
template <typename Element, int kHeadDim, bool Is_dropout, bool Is_masked>
void run_mha_bwd_(AttentionParams &params, cudaStream_t stream);
}  // namespace flash

template <int kHeadDim>
static void launch(flash::AttentionParams &params, bool backward) {
    using E = cutlass::bfloat16_t;
    if (backward) {
        params.is_masked ? flash::run_mha_bwd_<E, kHeadDim, false, true>(params, 0)
                         : flash::run_mha_bwd_<E, kHeadDim, false, false>(params, 0);
    } else {
        params.is_masked ? flash::run_mha_fwd_<E, kHeadDim, false, true>(params, 0)
                         : flash::run_mha_fwd_<E, kHeadDim, false, false>(params, 0);
    }
}

// The head dims this binary links (main rejects any other before launch falls back to 128).
#ifdef FLASH_BENCH_HDIM256  // built with BENCH_HDIM256=1
constexpr int kBuiltHeadDims[] = {64, 128, 256};
#else
constexpr int kBuiltHeadDims[] = {64, 128};
#endif

static void launch(flash::AttentionParams &params, bool backward) {
    switch (params.head_dim) {
        case 64: return launch<64>(params, backward);
#ifdef FLASH_BENCH_HDIM256
        case 256: return launch<256>(params, backward);
#endif
        default: return launch<128>(params, backward);
    }
}

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        cudaError_t err_ = (x);                                                                    \
        if (err_ != cudaSuccess) {                                                                 \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
            std::exit(1);                                                                          \
        }                                                                                          \
    } while (0)

__global__ void fill_random(__nv_bfloat16 *x, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        unsigned h = unsigned(i) * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        x[i] = __float2bfloat16((float(h & 0xffff) / 65536.f - 0.5f) * 3.4f);  // about unit variance
    }
}

struct Buffers {
    __nv_bfloat16 *q, *k, *v, *o, *dout, *dq, *dk, *dv;
    float *lse, *softmax_d, *dq_accum;
    size_t accum_bytes;
};

static float time_pass(flash::AttentionParams &params, const Buffers &buf, int reps, bool backward) {
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    // Kernels before the rowsum(dO * O) kernel zeroed dq_accum needed a memset in every backward
    // call; FLASH_BENCH_MEMSET_DQ_ACCUM=1 times them as the binding ran them.
    const char *memset_env = std::getenv("FLASH_BENCH_MEMSET_DQ_ACCUM");
    const bool memset_dq_accum = memset_env != nullptr && std::string(memset_env) == "1";
    auto once = [&] {
        if (backward && memset_dq_accum) { CHECK(cudaMemsetAsync(buf.dq_accum, 0, buf.accum_bytes)); }
        launch(params, backward);
    };
    for (int i = 0; i < std::min(reps, 3); ++i) { once(); }
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < reps; ++i) { once(); }
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    CHECK(cudaGetLastError());
    return ms / reps;
}

// A plain fp32 reference of the backward for one (batch 0, head 0) slice, to catch a kernel
// variant that is fast but wrong: P and dS are materialised (seqlen^2 floats each), so it is
// used at seqlen 1024 only.
__device__ float bf(const __nv_bfloat16 *x, size_t i) { return __bfloat162float(x[i]); }

__global__ void reference_rows(const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *v,
                               const __nv_bfloat16 *dout, int seqlen, int d, int64_t row, float scale,
                               bool causal, float *p, float *ds, float *dq, float *o_ref) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= seqlen) { return; }
    const int last = causal ? i : seqlen - 1;
    float m = -INFINITY;
    for (int j = 0; j <= last; ++j) {
        float s = 0.f;
        for (int c = 0; c < d; ++c) { s += bf(q, i * row + c) * bf(k, j * row + c); }
        p[size_t(i) * seqlen + j] = s * scale;
        m = fmaxf(m, s * scale);
    }
    float l = 0.f;
    for (int j = 0; j <= last; ++j) { l += expf(p[size_t(i) * seqlen + j] - m); }
    float d_i = 0.f;  // rowsum(dO * O) with O = P V
    for (int c = 0; c < d; ++c) {
        float o = 0.f;
        for (int j = 0; j <= last; ++j) { o += expf(p[size_t(i) * seqlen + j] - m) / l * bf(v, j * row + c); }
        o_ref[size_t(i) * d + c] = o;
        d_i += o * bf(dout, i * row + c);
    }
    for (int j = 0; j < seqlen; ++j) {
        float pij = 0.f, dsij = 0.f;
        if (j <= last) {
            pij = expf(p[size_t(i) * seqlen + j] - m) / l;
            float dp = 0.f;
            for (int c = 0; c < d; ++c) { dp += bf(dout, i * row + c) * bf(v, j * row + c); }
            dsij = pij * (dp - d_i);
        }
        p[size_t(i) * seqlen + j] = pij;
        ds[size_t(i) * seqlen + j] = dsij;
    }
    for (int c = 0; c < d; ++c) {
        float acc = 0.f;
        for (int j = 0; j <= last; ++j) { acc += ds[size_t(i) * seqlen + j] * bf(k, j * row + c); }
        dq[size_t(i) * d + c] = acc * scale;
    }
}

__global__ void reference_cols(const __nv_bfloat16 *q, const __nv_bfloat16 *dout, int seqlen, int d, int64_t row,
                               float scale, const float *p, const float *ds, float *dk, float *dv) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= seqlen) { return; }
    for (int c = 0; c < d; ++c) {
        float acc_k = 0.f, acc_v = 0.f;
        for (int i = 0; i < seqlen; ++i) {
            acc_k += ds[size_t(i) * seqlen + j] * bf(q, i * row + c);
            acc_v += p[size_t(i) * seqlen + j] * bf(dout, i * row + c);
        }
        dk[size_t(j) * d + c] = acc_k * scale;
        dv[size_t(j) * d + c] = acc_v;
    }
}

// Largest |ours - reference| over the slice, relative to the largest |reference|.
static float relative_error(const __nv_bfloat16 *ours_dev, const float *ref_dev, int seqlen, int d, int64_t row) {
    std::vector<__nv_bfloat16> ours(size_t(seqlen) * row);
    std::vector<float> ref(size_t(seqlen) * d);
    CHECK(cudaMemcpy(ours.data(), ours_dev, ours.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(ref.data(), ref_dev, ref.size() * sizeof(float), cudaMemcpyDeviceToHost));
    float err = 0.f, scale = 0.f;
    for (int i = 0; i < seqlen; ++i) {
        for (int c = 0; c < d; ++c) {
            const float r = ref[size_t(i) * d + c];
            err = std::fmax(err, std::fabs(__bfloat162float(ours[size_t(i) * row + c]) - r));
            scale = std::fmax(scale, std::fabs(r));
        }
    }
    return err / scale;
}

static bool check_backward(const Buffers &buf, int seqlen, int d, int64_t row, float scale, bool causal) {
    float *p, *ds, *ref[4];
    CHECK(cudaMalloc(&p, size_t(seqlen) * seqlen * sizeof(float)));
    CHECK(cudaMalloc(&ds, size_t(seqlen) * seqlen * sizeof(float)));
    for (float *&r : ref) { CHECK(cudaMalloc(&r, size_t(seqlen) * d * sizeof(float))); }
    reference_rows<<<(seqlen + 127) / 128, 128>>>(buf.q, buf.k, buf.v, buf.dout, seqlen, d, row, scale, causal, p,
                                                  ds, ref[0], ref[3]);
    reference_cols<<<(seqlen + 127) / 128, 128>>>(buf.q, buf.dout, seqlen, d, row, scale, p, ds, ref[1], ref[2]);
    CHECK(cudaDeviceSynchronize());
    const float err_dq = relative_error(buf.dq, ref[0], seqlen, d, row);
    const float err_dk = relative_error(buf.dk, ref[1], seqlen, d, row);
    const float err_dv = relative_error(buf.dv, ref[2], seqlen, d, row);
    const float err_o = relative_error(buf.o, ref[3], seqlen, d, row);
    // bf16 outputs of sums over a thousand terms: a few 1e-3 relative; a wrong layout gives O(1).
    const bool ok = err_dq < 2e-2f && err_dk < 2e-2f && err_dv < 2e-2f && err_o < 2e-2f;
    std::printf("check d%d%s s%d: max relative error o %.2e dq %.2e dk %.2e dv %.2e -> %s\n", d,
                causal ? " causal" : "", seqlen, err_o, err_dq, err_dk, err_dv, ok ? "OK" : "WRONG");
    for (float *r : {p, ds, ref[0], ref[1], ref[2], ref[3]}) { CHECK(cudaFree(r)); }
    return ok;
}

static void run_case(int head_dim, bool causal, int seqlen) {
    const int batch = 16384 / seqlen, heads = 2048 / head_dim;
    const size_t n = size_t(batch) * seqlen * heads * head_dim;
    const int seqlen_rounded = (seqlen + 127) / 128 * 128;
    Buffers buf{};
    for (__nv_bfloat16 **p : {&buf.q, &buf.k, &buf.v, &buf.o, &buf.dout, &buf.dq, &buf.dk, &buf.dv}) {
        CHECK(cudaMalloc(p, n * sizeof(__nv_bfloat16)));
    }
    CHECK(cudaMalloc(&buf.lse, size_t(batch) * heads * seqlen * sizeof(float)));
    CHECK(cudaMalloc(&buf.softmax_d, size_t(batch) * heads * seqlen * sizeof(float)));
    buf.accum_bytes = size_t(batch) * seqlen_rounded * heads * head_dim * sizeof(float);
    CHECK(cudaMalloc(&buf.dq_accum, buf.accum_bytes));
    unsigned seed = 1;
    for (__nv_bfloat16 *p : {buf.q, buf.k, buf.v, buf.dout}) { fill_random<<<1024, 256>>>(p, n, seed++); }

    flash::AttentionParams params;
    params.q_ptr = buf.q; params.k_ptr = buf.k; params.v_ptr = buf.v; params.o_ptr = buf.o;
    params.do_ptr = buf.dout; params.dq_ptr = buf.dq; params.dk_ptr = buf.dk; params.dv_ptr = buf.dv;
    const int64_t row = int64_t(heads) * head_dim, batch_stride = row * seqlen;
    for (int64_t *s : {&params.q_batch_stride, &params.k_batch_stride, &params.v_batch_stride, &params.o_batch_stride,
                       &params.do_batch_stride, &params.dq_batch_stride, &params.dk_batch_stride, &params.dv_batch_stride}) {
        *s = batch_stride;
    }
    for (int64_t *s : {&params.q_row_stride, &params.k_row_stride, &params.v_row_stride, &params.o_row_stride,
                       &params.do_row_stride, &params.dq_row_stride, &params.dk_row_stride, &params.dv_row_stride}) {
        *s = row;
    }
    for (int64_t *s : {&params.q_head_stride, &params.k_head_stride, &params.v_head_stride, &params.o_head_stride,
                       &params.do_head_stride, &params.dq_head_stride, &params.dk_head_stride, &params.dv_head_stride}) {
        *s = head_dim;
    }
    params.softmax_lse_ptr = buf.lse;
    params.softmax_d_ptr = buf.softmax_d;
    params.batch = batch; params.heads = heads; params.heads_k = heads; params.heads_per_head_k = 1;
    params.seqlen_q = params.seqlen_k = seqlen;
    params.seqlen_q_rounded = params.seqlen_k_rounded = seqlen_rounded;
    params.head_dim = head_dim;
    params.total_q = batch * seqlen;
    params.softmax_scale = params.score_scale = 1.f / std::sqrt(float(head_dim));
    params.score_scale_log2 = params.score_scale * 1.4426950408889634f;
    params.is_masked = causal;
    params.window_size_left = -1;
    params.window_size_right = causal ? 0 : -1;
    params.keep_prob = 1.f;  // no dropout
    params.is_bf16 = true;
    params.dq_accum_ptr = buf.dq_accum;
    // (splits, heads, rows, head_dim), as the binding allocates it.
    params.dq_accum_row_stride = head_dim;
    params.dq_accum_head_stride = int64_t(batch) * seqlen_rounded * head_dim;
    params.dq_accum_split_stride = int64_t(heads) * params.dq_accum_head_stride;
    params.num_splits = 1;

    // The forward also leaves O and the log-sum-exp the backward reads.
    // FLASH_BENCH_REPS: timed repetitions (and at most 3 warm-ups); 1 for a run under a sanitizer.
    const char *reps_env = std::getenv("FLASH_BENCH_REPS");
    const int reps = reps_env != nullptr ? std::max(1, std::atoi(reps_env)) : seqlen >= 4096 ? 5 : 20;
    const double fwd_flops = 4.0 * batch * double(seqlen) * seqlen * heads * head_dim / (causal ? 2 : 1);
    const float fwd_ms = time_pass(params, buf, reps, false);
    std::printf("| fwd | bf16 | %d | %s | %d | %d | %d | %.3f | %.1f |\n", head_dim, causal ? "True" : "False",
                seqlen, batch, heads, fwd_ms, fwd_flops / fwd_ms / 1e9);
    const char *fwd_only_env = std::getenv("FLASH_BENCH_FWD_ONLY");
    if (fwd_only_env == nullptr || std::atoi(fwd_only_env) == 0 || seqlen == 1024) {
        const float ms = time_pass(params, buf, reps, true);
        const double flops = 2.5 * fwd_flops;
        std::printf("| bwd | bf16 | %d | %s | %d | %d | %d | %.3f | %.1f |\n", head_dim, causal ? "True" : "False",
                    seqlen, batch, heads, ms, flops / ms / 1e9);
    }
    if (seqlen == 1024) { check_backward(buf, seqlen, head_dim, row, params.softmax_scale, causal); }
    for (void *p : {(void *)buf.q, (void *)buf.k, (void *)buf.v, (void *)buf.o, (void *)buf.dout, (void *)buf.dq,
                    (void *)buf.dk, (void *)buf.dv, (void *)buf.lse, (void *)buf.softmax_d, (void *)buf.dq_accum}) {
        CHECK(cudaFree(p));
    }
}

int main(int argc, char **argv) {
    std::vector<int> head_dims;
    if ((argc == 4 || (argc == 5 && std::string(argv[4]) == "causal")) && std::string(argv[1]) == "--one") {
        run_case(std::atoi(argv[2]), argc == 5, std::atoi(argv[3]));
        return 0;
    }
    for (int i = 1; i < argc; ++i) { head_dims.push_back(std::atoi(argv[i])); }
    if (head_dims.empty()) { head_dims = {64, 128}; }
    for (int d : head_dims) {
        if (std::find(std::begin(kBuiltHeadDims), std::end(kBuiltHeadDims), d) == std::end(kBuiltHeadDims)) {
            std::fprintf(stderr, "head_dim %d: this harness was built for 64 and 128 (and 256 with BENCH_HDIM256=1)\n", d);
            return 2;
        }
    }
    std::printf("| pass | dtype | d | causal | seqlen | batch | heads | ms | TFLOP/s |\n|---|---|---|---|---|---|---|---|---|\n");
    for (int d : head_dims) {
        for (bool causal : {false, true}) {
            for (int seqlen : {1024, 2048, 4096, 16384}) { run_case(d, causal, seqlen); }
        }
    }
    return 0;
}
