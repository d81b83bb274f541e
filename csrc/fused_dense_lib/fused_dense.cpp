// Torch binding of fused_dense_lib: validates arguments, allocates outputs, and hands plain pointers
// to the cuBLASLt code in fused_dense_cuda.cu (the workspace is PyTorch's cuBLASLt workspace).
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <cuda_runtime.h>

#include <optional>
#include <sstream>
#include <vector>

#include "fused_dense_cuda.h"

namespace {

constexpr int64_t kAny = -1;

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "");
    if (shape[i] == kAny) out << "*"; else out << shape[i];
  }
  out << "]";
  return out.str();
}

// The one check of a tensor argument: CUDA, on `device`, one of `dtypes`, `shape` (kAny matches any
// size), contiguous and non-empty. Errors name the op, the argument and what was expected.
void check_arg(const char* op, const at::Tensor& t, const char* name, at::ArrayRef<at::ScalarType> dtypes,
               const at::Device& device, at::IntArrayRef shape) {
  TORCH_CHECK(t.defined(), "fused_dense_lib.", op, ": ", name, " must be a tensor (got None)");
  TORCH_CHECK(t.is_cuda(), "fused_dense_lib.", op, ": ", name, " must be a CUDA tensor (got one on ", t.device(), ")");
  TORCH_CHECK(t.device() == device, "fused_dense_lib.", op, ": ", name, " must be on ", device,
              " like the first argument (got ", t.device(), ")");
  bool dtype_ok = false;
  std::ostringstream wanted;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    dtype_ok = dtype_ok || t.scalar_type() == dtypes[i];
    wanted << (i ? " or " : "") << dtypes[i];
  }
  TORCH_CHECK(dtype_ok, "fused_dense_lib.", op, ": ", name, " must have dtype ", wanted.str(), " (got ",
              t.scalar_type(), ")");
  bool shape_ok = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; shape_ok && i < shape.size(); ++i) shape_ok = shape[i] == kAny || t.size(i) == shape[i];
  TORCH_CHECK(shape_ok, "fused_dense_lib.", op, ": ", name, " must have shape ", shape_string(shape), " (got ",
              shape_string(t.sizes()), ")");
  TORCH_CHECK(t.numel() > 0, "fused_dense_lib.", op, ": ", name, " must not be empty (got shape ",
              shape_string(t.sizes()), ")");
  TORCH_CHECK(t.is_contiguous(), "fused_dense_lib.", op, ": ", name, " must be contiguous (got strides ",
              t.strides(), "); call .contiguous() first");
}

void check_heuristic(const char* op, int64_t heuristic) {
  TORCH_CHECK(heuristic >= 0, "fused_dense_lib.", op, ": heuristic must be >= 0 (got ", heuristic,
              "); -1 (unfused) is handled in Python by flash_attn.ops.fused_dense");
}

void check_status(const char* op, const fused_dense::Status& status) {
  TORCH_CHECK(status.ok(), "fused_dense_lib.", op, ": ", status.message);
}

fused_dense::DType dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf ? fused_dense::DType::kFloat16 : fused_dense::DType::kBFloat16;
}

// PyTorch's own cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE, 1 MiB by default), the buffer and its
// size: no allocation per call, and the heuristic sees what it sees for F.linear and
// torch._addmm_activation, so candidate 0 is PyTorch's algorithm for the same problem.
// The caller holds a CUDAGuard for `like`'s device; the buffer belongs to its current stream.
fused_dense::LtContext make_context(const at::Tensor& like, bool with_workspace) {
  fused_dense::LtContext ctx;
  ctx.device = like.get_device();
  ctx.stream = c10::cuda::getCurrentCUDAStream(ctx.device).stream();
  ctx.workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  ctx.workspace = with_workspace ? at::cuda::getCUDABlasLtWorkspace() : nullptr;
  return ctx;
}

constexpr at::ScalarType kHalfTypes[] = {at::kHalf, at::kBFloat16};

struct ForwardCall {
  fused_dense::LinearActParams params;
  at::Tensor output, pre_act;
};

ForwardCall prepare_forward(const char* op, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool is_gelu, bool save_pre_act) {
  check_arg(op, input, "input", kHalfTypes, input.device(), {kAny, kAny});
  const int64_t batch_size = input.size(0), in_features = input.size(1);
  check_arg(op, weight, "weight", {input.scalar_type()}, input.device(), {kAny, in_features});
  const int64_t out_features = weight.size(0);
  if (bias.has_value()) check_arg(op, *bias, "bias", {input.scalar_type()}, input.device(), {out_features});
  if (save_pre_act) {
    // cuBLASLt's leading-dimension rule for the auxiliary output (elements for GELU, bits for ReLU).
    const int64_t multiple = is_gelu ? 8 : 128;
    TORCH_CHECK(out_features % multiple == 0, "fused_dense_lib.", op, ": out_features (weight.size(0) = ",
                out_features, ") must be a multiple of ", multiple, " to save the ",
                is_gelu ? "GELU input" : "ReLU bit-mask", "; pass save_pre_act=False or pad the layer");
  }
  ForwardCall call;
  call.output = at::empty({batch_size, out_features}, input.options());
  if (save_pre_act) {
    call.pre_act = is_gelu ? at::empty({batch_size, out_features}, input.options())
                           : at::empty({batch_size, out_features / 8}, input.options().dtype(at::kByte));
  }
  call.params = {dtype_of(input),
                 input.data_ptr(),
                 weight.data_ptr(),
                 bias.has_value() ? bias->data_ptr() : nullptr,
                 call.output.data_ptr(),
                 save_pre_act ? call.pre_act.data_ptr() : nullptr,
                 batch_size,
                 in_features,
                 out_features,
                 is_gelu ? fused_dense::Activation::kGelu : fused_dense::Activation::kRelu};
  return call;
}

struct DgradCall {
  fused_dense::DgradParams params;
  at::Tensor d_input, d_bias;
};

DgradCall prepare_dgrad(const char* op, const at::Tensor& weight, const at::Tensor& d_output,
                        const at::Tensor& pre_act, bool is_gelu, bool with_bias_grad) {
  check_arg(op, weight, "weight", kHalfTypes, weight.device(), {kAny, kAny});
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  check_arg(op, d_output, "d_output", {weight.scalar_type()}, weight.device(), {kAny, out_features});
  const int64_t batch_size = d_output.size(0);
  const int64_t multiple = is_gelu ? 8 : 128;
  TORCH_CHECK(in_features % multiple == 0, "fused_dense_lib.", op, ": in_features (weight.size(1) = ", in_features,
              ") must be a multiple of ", multiple, " for the ", is_gelu ? "GELU" : "ReLU bit-mask",
              " epilogue input");
  if (is_gelu) {
    check_arg(op, pre_act, "pre_act", {weight.scalar_type()}, weight.device(), {batch_size, in_features});
  } else {
    check_arg(op, pre_act, "pre_act", {at::kByte}, weight.device(), {batch_size, in_features / 8});
  }
  DgradCall call;
  call.d_input = at::empty({batch_size, in_features}, weight.options());
  if (with_bias_grad) call.d_bias = at::empty({in_features}, weight.options());
  call.params = {dtype_of(weight),
                 weight.data_ptr(),
                 d_output.data_ptr(),
                 pre_act.data_ptr(),
                 call.d_input.data_ptr(),
                 with_bias_grad ? call.d_bias.data_ptr() : nullptr,
                 batch_size,
                 in_features,
                 out_features,
                 is_gelu ? fused_dense::Activation::kGelu : fused_dense::Activation::kRelu};
  return call;
}

}  // namespace

std::vector<at::Tensor> linear_act_forward(const at::Tensor& input, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias, bool is_gelu, bool save_pre_act,
                                           int64_t heuristic) {
  const char* op = "linear_act_forward";
  check_heuristic(op, heuristic);
  ForwardCall call = prepare_forward(op, input, weight, bias, is_gelu, save_pre_act);
  const c10::cuda::CUDAGuard device_guard(input.device());
  check_status(op, fused_dense::linear_act_forward(make_context(input, true), call.params,
                                                   static_cast<int>(heuristic)));
  if (!save_pre_act) return {call.output};
  return {call.output, call.pre_act};
}

int64_t linear_act_forward_num_algos(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, bool is_gelu, bool save_pre_act) {
  const char* op = "linear_act_forward_num_algos";
  ForwardCall call = prepare_forward(op, input, weight, bias, is_gelu, save_pre_act);
  const c10::cuda::CUDAGuard device_guard(input.device());
  int count = 0;
  check_status(op, fused_dense::linear_act_forward_num_algos(make_context(input, false), call.params, &count));
  return count;
}

std::vector<at::Tensor> linear_bias_wgrad(const at::Tensor& input, const at::Tensor& d_output, bool has_d_bias,
                                          bool fp32_grads) {
  const char* op = "linear_bias_wgrad";
  check_arg(op, input, "input", kHalfTypes, input.device(), {kAny, kAny});
  const int64_t batch_size = input.size(0), in_features = input.size(1);
  check_arg(op, d_output, "d_output", {input.scalar_type()}, input.device(), {batch_size, kAny});
  const int64_t out_features = d_output.size(1);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto grad_options = fp32_grads ? input.options().dtype(at::kFloat) : input.options();
  at::Tensor d_weight = at::empty({out_features, in_features}, grad_options);
  at::Tensor d_bias = has_d_bias ? at::empty({out_features}, grad_options) : at::Tensor();
  fused_dense::WgradParams params = {dtype_of(input), input.data_ptr(), d_output.data_ptr(), d_weight.data_ptr(),
                                     has_d_bias ? d_bias.data_ptr() : nullptr, batch_size, in_features,
                                     out_features, fp32_grads};
  const fused_dense::LtContext ctx = make_context(input, true);
  fused_dense::Status status = fused_dense::linear_bias_wgrad(ctx, params);
  if (status.code == fused_dense::Status::kNoAlgorithm && has_d_bias) {
    // The BGRADB epilogue is refused for this shape: a plain GEMM, and the bias gradient on its own.
    params.d_bias = nullptr;
    status = fused_dense::linear_bias_wgrad(ctx, params);
    if (status.ok()) d_bias = d_output.sum({0}, /*keepdim=*/false, fp32_grads ? at::kFloat : input.scalar_type());
  }
  check_status(op, status);
  return {d_weight, d_bias};
}

// The backward through the activation, with (bias_act_linear_dgrad_bgrad) or without
// (act_linear_dgrad) the bias gradient in the same epilogue: one implementation of each entry.
DgradCall run_dgrad(const char* op, const at::Tensor& weight, const at::Tensor& d_output, const at::Tensor& pre_act,
                    bool is_gelu, int64_t heuristic, bool with_bias_grad) {
  check_heuristic(op, heuristic);
  DgradCall call = prepare_dgrad(op, weight, d_output, pre_act, is_gelu, with_bias_grad);
  const c10::cuda::CUDAGuard device_guard(weight.device());
  check_status(op, fused_dense::bias_act_linear_dgrad_bgrad(make_context(weight, true), call.params,
                                                            static_cast<int>(heuristic)));
  return call;
}

int64_t dgrad_num_algos(const char* op, const at::Tensor& weight, const at::Tensor& d_output,
                        const at::Tensor& pre_act, bool is_gelu, bool with_bias_grad) {
  DgradCall call = prepare_dgrad(op, weight, d_output, pre_act, is_gelu, with_bias_grad);
  const c10::cuda::CUDAGuard device_guard(weight.device());
  int count = 0;
  check_status(op, fused_dense::bias_act_linear_dgrad_bgrad_num_algos(make_context(weight, false), call.params,
                                                                      &count));
  return count;
}

std::vector<at::Tensor> bias_act_linear_dgrad_bgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                                    const at::Tensor& pre_act, bool is_gelu, int64_t heuristic) {
  DgradCall call = run_dgrad("bias_act_linear_dgrad_bgrad", weight, d_output, pre_act, is_gelu, heuristic, true);
  return {call.d_input, call.d_bias};
}

int64_t bias_act_linear_dgrad_bgrad_num_algos(const at::Tensor& weight, const at::Tensor& d_output,
                                              const at::Tensor& pre_act, bool is_gelu) {
  return dgrad_num_algos("bias_act_linear_dgrad_bgrad_num_algos", weight, d_output, pre_act, is_gelu, true);
}

at::Tensor act_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output, const at::Tensor& pre_act,
                            bool is_gelu, int64_t heuristic) {
  return run_dgrad("act_linear_dgrad", weight, d_output, pre_act, is_gelu, heuristic, false).d_input;
}

int64_t act_linear_dgrad_num_algos(const at::Tensor& weight, const at::Tensor& d_output, const at::Tensor& pre_act,
                                   bool is_gelu) {
  return dgrad_num_algos("act_linear_dgrad_num_algos", weight, d_output, pre_act, is_gelu, false);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cuBLASLt GEMM + bias + GELU/ReLU epilogues (forward, weight and input gradients)";
  m.attr("max_heuristic_algos") = fused_dense::kMaxHeuristicAlgos;
  m.def("linear_act_forward", &linear_act_forward,
        "act(input @ weight.T + bias) in one cuBLASLt GEMM (GELU tanh-approx or ReLU epilogue); returns [output] "
        "or, with save_pre_act, [output, pre_act]: the GELU input [batch, out] or the ReLU bit-mask uint8 "
        "[batch, out / 8]. heuristic picks the heuristic's candidate (past the last one: the last one).",
        py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("is_gelu"), py::arg("save_pre_act"),
        py::arg("heuristic"));
  m.def("linear_bias_wgrad", &linear_bias_wgrad,
        "[d_weight = d_output.T @ input, d_bias = d_output.sum(0) or None], the bias gradient from the BGRADB "
        "epilogue of the same GEMM (a plain GEMM and a sum where the epilogue is refused); fp32_grads: both in "
        "fp32 (the gradients of fp32 parameters under autocast) instead of input's dtype",
        py::arg("input"), py::arg("d_output"), py::arg("has_d_bias"), py::arg("fp32_grads") = false);
  m.def("bias_act_linear_dgrad_bgrad", &bias_act_linear_dgrad_bgrad,
        "[d_input = act'(pre_act) * (d_output @ weight), d_bias = d_input.sum(0)] through the DGELU_BGRAD or "
        "DRELU_BGRAD epilogue; pre_act is what linear_act_forward saved",
        py::arg("weight"), py::arg("d_output"), py::arg("pre_act"), py::arg("is_gelu"), py::arg("heuristic"));
  m.def("act_linear_dgrad", &act_linear_dgrad,
        "d_input = act'(pre_act) * (d_output @ weight) through the DGELU or DRELU epilogue, without the bias "
        "gradient (take it from the next weight gradient's BGRADB epilogue)",
        py::arg("weight"), py::arg("d_output"), py::arg("pre_act"), py::arg("is_gelu"), py::arg("heuristic"));
  m.def("act_linear_dgrad_num_algos", &act_linear_dgrad_num_algos,
        "how many candidates (<= max_heuristic_algos) the heuristic offers act_linear_dgrad",
        py::arg("weight"), py::arg("d_output"), py::arg("pre_act"), py::arg("is_gelu"));
  m.def("linear_act_forward_num_algos", &linear_act_forward_num_algos,
        "how many candidates (<= max_heuristic_algos) the heuristic offers linear_act_forward for these arguments",
        py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("is_gelu"), py::arg("save_pre_act"));
  m.def("bias_act_linear_dgrad_bgrad_num_algos", &bias_act_linear_dgrad_bgrad_num_algos,
        "how many candidates (<= max_heuristic_algos) the heuristic offers bias_act_linear_dgrad_bgrad",
        py::arg("weight"), py::arg("d_output"), py::arg("pre_act"), py::arg("is_gelu"));
}
