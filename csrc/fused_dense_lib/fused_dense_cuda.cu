// cuBLASLt GEMMs with fused epilogues: bias + GELU/ReLU forward, weight gradient with the bias
// gradient (BGRADB), and the activation's gradient with the bias gradient (DGELU/DRELU_BGRAD).
//
// cuBLASLt is column-major and a row-major [rows, cols] tensor is a column-major [cols, rows] one,
// so every GEMM here computes the transpose of the torch-side result: D = out^T, with m = features
// and n = batch. The epilogue's bias holds one value per row of D, that is one per feature, which
// is what a Linear layer needs.
#include "fused_dense_cuda.h"

#include <cublasLt.h>

#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace fused_dense {
namespace {

Status lt_error(const char* call, cublasStatus_t status) {
  Status result;
  result.code = Status::kCublasError;
  result.message = std::string(call) + " failed: " + cublasLtGetStatusName(status) + " (" +
                   cublasLtGetStatusString(status) + ")";
  return result;
}

#define LT_CHECK(what, expr)                                        \
  do {                                                              \
    cublasStatus_t lt_status_ = (expr);                             \
    if (lt_status_ != CUBLAS_STATUS_SUCCESS) return lt_error(what, lt_status_); \
  } while (0)

// One handle per device, created on first use and kept for the life of the process (cuBLASLt
// handles are cheap to share and costly to create per call).
Status handle_for(int device, cublasLtHandle_t* handle) {
  static std::mutex mutex;
  static std::vector<cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(handles.size())) handles.resize(device + 1, nullptr);
  if (handles[device] == nullptr) LT_CHECK("cublasLtCreate", cublasLtCreate(&handles[device]));
  *handle = handles[device];
  return Status();
}

cudaDataType_t cuda_type(DType dtype) {
  return dtype == DType::kFloat16 ? CUDA_R_16F : CUDA_R_16BF;
}

// The heuristic assumes 256-byte aligned buffers unless told otherwise; a sliced tensor that is
// less aligned would otherwise get an algorithm that cannot run on it.
uint32_t alignment_of(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// One column-major GEMM D[m, n] = op(A)[m, k] * op(B)[k, n] with an epilogue.
struct GemmSpec {
  cudaDataType_t dtype;
  cublasOperation_t trans_a, trans_b;
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;
  int64_t ldd;
  cublasLtEpilogue_t epilogue;
  bool fp32_output = false;    // D (and a bias gradient) in fp32 instead of dtype
  const void* bias = nullptr;  // bias (input) or bias gradient (output)
  const void* aux = nullptr;   // GELU input or ReLU bit-mask
  int64_t aux_ld = 0;
};

// Owns the descriptors of one GEMM; destroyed on every return path.
class LtGemm {
 public:
  explicit LtGemm(const GemmSpec& spec) : spec_(spec) {}
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm() {
    if (preference_) cublasLtMatmulPreferenceDestroy(preference_);
    if (layout_d_) cublasLtMatrixLayoutDestroy(layout_d_);
    if (layout_b_) cublasLtMatrixLayoutDestroy(layout_b_);
    if (layout_a_) cublasLtMatrixLayoutDestroy(layout_a_);
    if (desc_) cublasLtMatmulDescDestroy(desc_);
  }

  Status describe(size_t workspace_bytes) {
    const GemmSpec& s = spec_;
    LT_CHECK("cublasLtMatmulDescCreate", cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_CHECK("cublasLtMatmulDescSetAttribute(TRANSA)", set_desc(CUBLASLT_MATMUL_DESC_TRANSA, s.trans_a));
    LT_CHECK("cublasLtMatmulDescSetAttribute(TRANSB)", set_desc(CUBLASLT_MATMUL_DESC_TRANSB, s.trans_b));
    LT_CHECK("cublasLtMatmulDescSetAttribute(EPILOGUE)", set_desc(CUBLASLT_MATMUL_DESC_EPILOGUE, s.epilogue));
    if (s.bias != nullptr) {
      LT_CHECK("cublasLtMatmulDescSetAttribute(BIAS_POINTER)", set_desc(CUBLASLT_MATMUL_DESC_BIAS_POINTER, s.bias));
    }
    if (s.aux != nullptr) {
      LT_CHECK("cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER)",
               set_desc(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, s.aux));
      LT_CHECK("cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_LD)",
               set_desc(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, s.aux_ld));
    }
    const bool a_plain = s.trans_a == CUBLAS_OP_N, b_plain = s.trans_b == CUBLAS_OP_N;
    LT_CHECK("cublasLtMatrixLayoutCreate(A)",
             cublasLtMatrixLayoutCreate(&layout_a_, s.dtype, a_plain ? s.m : s.k, a_plain ? s.k : s.m, s.lda));
    LT_CHECK("cublasLtMatrixLayoutCreate(B)",
             cublasLtMatrixLayoutCreate(&layout_b_, s.dtype, b_plain ? s.k : s.n, b_plain ? s.n : s.k, s.ldb));
    LT_CHECK("cublasLtMatrixLayoutCreate(D)",
             cublasLtMatrixLayoutCreate(&layout_d_, s.fp32_output ? CUDA_R_32F : s.dtype, s.m, s.n, s.ldd));

    LT_CHECK("cublasLtMatmulPreferenceCreate", cublasLtMatmulPreferenceCreate(&preference_));
    const uint64_t max_workspace = workspace_bytes;
    LT_CHECK("cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)",
             set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_workspace));
    LT_CHECK("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_A_BYTES)",
             set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(s.a)));
    LT_CHECK("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_B_BYTES)",
             set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(s.b)));
    // C is D (beta = 0), so both get D's alignment.
    LT_CHECK("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_C_BYTES)",
             set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(s.d)));
    LT_CHECK("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_D_BYTES)",
             set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(s.d)));
    return Status();
  }

  // The heuristic's candidates, best first; count 0 (not an error) when it has none. Candidate 0 is
  // the answer to a request for one algorithm, as PyTorch asks for its own cuBLASLt epilogues
  // (torch._addmm_activation, F.linear with a bias): a longer request need not put that one first.
  Status candidates(cublasLtHandle_t handle, cublasLtMatmulHeuristicResult_t* results, int* count) {
    *count = 0;
    int first_count = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc_, layout_a_, layout_b_, layout_d_, layout_d_,
                                                           preference_, 1, results, &first_count);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED) return Status();
    LT_CHECK("cublasLtMatmulAlgoGetHeuristic", status);
    if (first_count == 0) return Status();
    cublasLtMatmulHeuristicResult_t more[kMaxHeuristicAlgos];
    int more_count = 0;
    status = cublasLtMatmulAlgoGetHeuristic(handle, desc_, layout_a_, layout_b_, layout_d_, layout_d_, preference_,
                                            kMaxHeuristicAlgos, more, &more_count);
    if (status != CUBLAS_STATUS_SUCCESS) more_count = 0;  // candidate 0 alone still runs
    *count = 1;
    for (int i = 0; i < more_count && *count < kMaxHeuristicAlgos; ++i) {
      if (std::memcmp(&more[i].algo, &results[0].algo, sizeof(cublasLtMatmulAlgo_t)) != 0) {
        results[(*count)++] = more[i];
      }
    }
    return Status();
  }

  Status run(cublasLtHandle_t handle, const LtContext& ctx, const cublasLtMatmulAlgo_t& algo) {
    const float alpha = 1.0f, beta = 0.0f;
    const GemmSpec& s = spec_;
    LT_CHECK("cublasLtMatmul",
             cublasLtMatmul(handle, desc_, &alpha, s.a, layout_a_, s.b, layout_b_, &beta, s.d, layout_d_, s.d,
                            layout_d_, &algo, ctx.workspace, ctx.workspace_bytes, ctx.stream));
    return Status();
  }

 private:
  template <typename T>
  cublasStatus_t set_desc(cublasLtMatmulDescAttributes_t attribute, const T& value) {
    return cublasLtMatmulDescSetAttribute(desc_, attribute, &value, sizeof(value));
  }
  template <typename T>
  cublasStatus_t set_pref(cublasLtMatmulPreferenceAttributes_t attribute, const T& value) {
    return cublasLtMatmulPreferenceSetAttribute(preference_, attribute, &value, sizeof(value));
  }

  GemmSpec spec_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t layout_a_ = nullptr, layout_b_ = nullptr, layout_d_ = nullptr;
  cublasLtMatmulPreference_t preference_ = nullptr;
};

// The heuristic's answer depends on the problem, not on the buffers beyond their alignment, and
// asking costs tens of microseconds of CPU per call: answers are kept per problem.
struct Candidates {
  cublasLtMatmulHeuristicResult_t results[kMaxHeuristicAlgos];
  int count = 0;
};

using ProblemKey = std::tuple<int, int, bool, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int,
                              bool, bool, int64_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, size_t>;

ProblemKey problem_key(const LtContext& ctx, const GemmSpec& s) {
  return ProblemKey(ctx.device, s.dtype, s.fp32_output, s.trans_a, s.trans_b, s.m, s.n, s.k, s.lda, s.ldb, s.ldd,
                    s.epilogue, s.bias != nullptr, s.aux != nullptr, s.aux_ld, alignment_of(s.a), alignment_of(s.b),
                    alignment_of(s.d), alignment_of(s.bias), alignment_of(s.aux), ctx.workspace_bytes);
}

Status candidates_for(const LtContext& ctx, const GemmSpec& spec, cublasLtHandle_t handle, LtGemm& gemm,
                      Candidates* out) {
  static std::mutex mutex;
  static std::map<ProblemKey, Candidates> cache;
  const ProblemKey key = problem_key(ctx, spec);
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto hit = cache.find(key);
    if (hit != cache.end()) {
      *out = hit->second;
      return Status();
    }
  }
  Status status = gemm.candidates(handle, out->results, &out->count);
  if (!status.ok()) return status;
  std::lock_guard<std::mutex> lock(mutex);
  if (cache.size() >= 4096) cache.clear();  // bounded, for callers whose row count keeps changing
  cache.emplace(key, *out);
  return Status();
}

Status count_algos(const LtContext& ctx, const GemmSpec& spec, int* count) {
  cublasLtHandle_t handle;
  Status status = handle_for(ctx.device, &handle);
  if (!status.ok()) return status;
  LtGemm gemm(spec);
  status = gemm.describe(ctx.workspace_bytes);
  if (!status.ok()) return status;
  Candidates candidates;
  status = candidates_for(ctx, spec, handle, gemm, &candidates);
  *count = candidates.count;
  return status;
}

Status run_gemm(const LtContext& ctx, const GemmSpec& spec, int heuristic) {
  cublasLtHandle_t handle;
  Status status = handle_for(ctx.device, &handle);
  if (!status.ok()) return status;
  LtGemm gemm(spec);
  status = gemm.describe(ctx.workspace_bytes);
  if (!status.ok()) return status;
  Candidates candidates;
  status = candidates_for(ctx, spec, handle, gemm, &candidates);
  if (!status.ok()) return status;
  const int count = candidates.count;
  const cublasLtMatmulHeuristicResult_t* results = candidates.results;
  if (count == 0) {
    status.code = Status::kNoAlgorithm;
    status.message = "cublasLtMatmulAlgoGetHeuristic returned no algorithm for this epilogue and shape";
    return status;
  }
  const int index = heuristic < count ? heuristic : count - 1;
  return gemm.run(handle, ctx, results[index].algo);
}

GemmSpec forward_spec(const LinearActParams& p) {
  GemmSpec s;
  s.dtype = cuda_type(p.dtype);
  s.trans_a = CUBLAS_OP_T;  // weight [out, in] row-major is [in, out] column-major
  s.trans_b = CUBLAS_OP_N;  // input [batch, in] row-major is [in, batch] column-major
  s.m = p.out_features;
  s.n = p.batch_size;
  s.k = p.in_features;
  s.a = p.weight;
  s.lda = p.in_features;
  s.b = p.input;
  s.ldb = p.in_features;
  s.d = p.output;
  s.ldd = p.out_features;
  const bool bias = p.bias != nullptr, aux = p.pre_act != nullptr;
  if (p.activation == Activation::kGelu) {
    s.epilogue = bias ? (aux ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS)
                      : (aux ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_GELU);
  } else {
    s.epilogue = bias ? (aux ? CUBLASLT_EPILOGUE_RELU_AUX_BIAS : CUBLASLT_EPILOGUE_RELU_BIAS)
                      : (aux ? CUBLASLT_EPILOGUE_RELU_AUX : CUBLASLT_EPILOGUE_RELU);
  }
  s.bias = p.bias;
  s.aux = p.pre_act;
  s.aux_ld = p.out_features;  // elements for GELU, bits for the ReLU mask
  return s;
}

GemmSpec wgrad_spec(const WgradParams& p, bool with_bias_grad) {
  GemmSpec s;
  s.dtype = cuda_type(p.dtype);
  // d_weight [out, in] row-major is D = [in, out] column-major = A * op(B) with A = input
  // ([in, batch] column-major) and op(B) = d_output^T, k = batch. BGRADB sums B over k: d_bias.
  s.trans_a = CUBLAS_OP_N;
  s.trans_b = CUBLAS_OP_T;
  s.m = p.in_features;
  s.n = p.out_features;
  s.k = p.batch_size;
  s.a = p.input;
  s.lda = p.in_features;
  s.b = p.d_output;
  s.ldb = p.out_features;
  s.d = p.d_weight;
  s.ldd = p.in_features;
  s.epilogue = with_bias_grad ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_DEFAULT;
  // The bias gradient takes D's type (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE left at its default).
  s.fp32_output = p.fp32_grads;
  s.bias = with_bias_grad ? p.d_bias : nullptr;
  return s;
}

GemmSpec dgrad_spec(const DgradParams& p) {
  GemmSpec s;
  s.dtype = cuda_type(p.dtype);
  // d_input [batch, in] row-major = [in, batch] column-major = weight ([in, out] column-major)
  // times d_output ([out, batch] column-major); the epilogue multiplies by act'(pre_act) and sums
  // the result over the batch (one value per row of D: the bias gradient).
  s.trans_a = CUBLAS_OP_N;
  s.trans_b = CUBLAS_OP_N;
  s.m = p.in_features;
  s.n = p.batch_size;
  s.k = p.out_features;
  s.a = p.weight;
  s.lda = p.in_features;
  s.b = p.d_output;
  s.ldb = p.out_features;
  s.d = p.d_input;
  s.ldd = p.in_features;
  // Without d_bias: DGELU / DRELU alone, the bias gradient then comes from elsewhere (the BGRADB
  // epilogue of the first layer's weight gradient, which reads the same matrix anyway).
  const bool gelu = p.activation == Activation::kGelu;
  if (p.d_bias != nullptr) {
    s.epilogue = gelu ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DRELU_BGRAD;
  } else {
    s.epilogue = gelu ? CUBLASLT_EPILOGUE_DGELU : CUBLASLT_EPILOGUE_DRELU;
  }
  s.bias = p.d_bias;
  s.aux = p.pre_act;
  s.aux_ld = p.in_features;
  return s;
}

}  // namespace

Status linear_act_forward(const LtContext& ctx, const LinearActParams& params, int heuristic) {
  return run_gemm(ctx, forward_spec(params), heuristic);
}

Status linear_act_forward_num_algos(const LtContext& ctx, const LinearActParams& params, int* count) {
  return count_algos(ctx, forward_spec(params), count);
}

Status linear_bias_wgrad(const LtContext& ctx, const WgradParams& params) {
  return run_gemm(ctx, wgrad_spec(params, params.d_bias != nullptr), 0);
}

Status bias_act_linear_dgrad_bgrad(const LtContext& ctx, const DgradParams& params, int heuristic) {
  return run_gemm(ctx, dgrad_spec(params), heuristic);
}

Status bias_act_linear_dgrad_bgrad_num_algos(const LtContext& ctx, const DgradParams& params, int* count) {
  return count_algos(ctx, dgrad_spec(params), count);
}

}  // namespace fused_dense
