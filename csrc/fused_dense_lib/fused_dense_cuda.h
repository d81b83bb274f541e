// Interface of the cuBLASLt GEMMs with fused epilogues. Plain C++ on purpose (no torch, no cuBLAS
// types), so the binding and the CUDA translation unit compile independently of each other.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fused_dense {

enum class DType { kFloat16, kBFloat16 };
enum class Activation { kGelu, kRelu };  // GELU is the tanh approximation, as cuBLASLt computes it

// How many of the heuristic's algorithms a caller may pick from (`heuristic` 0..kMaxHeuristicAlgos-1).
constexpr int kMaxHeuristicAlgos = 5;

// Where a GEMM runs; the workspace belongs to the caller (the binding takes it from torch's allocator).
struct LtContext {
  int device;
  cudaStream_t stream;
  void* workspace;  // may be null when only the heuristic is queried
  size_t workspace_bytes;
};

// Outcome of a call. kNoAlgorithm: cuBLASLt offers no algorithm for this epilogue and shape, which
// the wgrad entry turns into its plain-GEMM fallback; kCublasError names the failed call.
struct Status {
  enum Code { kOk, kNoAlgorithm, kCublasError };
  Code code = kOk;
  std::string message;
  bool ok() const { return code == kOk; }
};

// output[b, o] = act(sum_i input[b, i] * weight[o, i] + bias[o]), all row-major.
// pre_act (optional): GELU input [batch, out] in the same dtype, or the ReLU bit-mask with one bit
// per element (out_features bits per row, out_features a multiple of 128).
struct LinearActParams {
  DType dtype;
  const void* input;   // [batch_size, in_features]
  const void* weight;  // [out_features, in_features]
  const void* bias;    // [out_features] or null
  void* output;        // [batch_size, out_features]
  void* pre_act;       // see above, or null
  int64_t batch_size, in_features, out_features;
  Activation activation;
};

// d_weight[o, i] = sum_b d_output[b, o] * input[b, i]; d_bias[o] = sum_b d_output[b, o] when
// d_bias is not null (the BGRADB epilogue). fp32_grads: d_weight and d_bias are fp32, as the
// gradients of fp32 parameters under autocast are, so that no cast follows the GEMM.
struct WgradParams {
  DType dtype;
  const void* input;     // [batch_size, in_features]
  const void* d_output;  // [batch_size, out_features]
  void* d_weight;        // [out_features, in_features]
  void* d_bias;          // [out_features] or null
  int64_t batch_size, in_features, out_features;
  bool fp32_grads = false;
};

// d_input[b, i] = act'(pre_act[b, i]) * sum_o d_output[b, o] * weight[o, i];
// d_bias[i] = sum_b d_input[b, i] when d_bias is not null (DGELU_BGRAD / DRELU_BGRAD epilogue;
// DGELU / DRELU without it). Here "input" is the activation's input of the forward.
struct DgradParams {
  DType dtype;
  const void* weight;    // [out_features, in_features]
  const void* d_output;  // [batch_size, out_features]
  const void* pre_act;   // GELU input [batch_size, in_features] or ReLU bit-mask
  void* d_input;         // [batch_size, in_features]
  void* d_bias;          // [in_features] or null
  int64_t batch_size, in_features, out_features;
  Activation activation;
};

// `heuristic` indexes the heuristic's candidate list; past its end the last candidate runs.
Status linear_act_forward(const LtContext& ctx, const LinearActParams& params, int heuristic);
Status linear_bias_wgrad(const LtContext& ctx, const WgradParams& params);
Status bias_act_linear_dgrad_bgrad(const LtContext& ctx, const DgradParams& params, int heuristic);

// Number of candidates (at most kMaxHeuristicAlgos) the heuristic returns for exactly this problem
// (shapes, pointer alignments, workspace size); 0 when it returns none.
Status linear_act_forward_num_algos(const LtContext& ctx, const LinearActParams& params, int* count);
Status bias_act_linear_dgrad_bgrad_num_algos(const LtContext& ctx, const DgradParams& params, int* count);

}  // namespace fused_dense
