// Torch binding of the fused dropout + residual + LayerNorm / RMSNorm kernels: argument checks,
// output allocation, the Philox state, one params struct per direction. The names and argument
// lists are flash-attn's `dropout_layer_norm` module's.
//
// Supported dtypes, flash-attn's table: input fp32 / fp16 / bf16 (the output has the input dtype);
// the residual and the pre-norm sum in the input dtype or fp32; weights (gamma, beta, colscale and
// their gradients) in fp32 or the input dtype, or fp16 with fp32 input (not fp16 with bf16 input);
// arithmetic and statistics always fp32. Hidden size: a multiple of 8, at most 8192.

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "ln.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Launch-shape overrides for tuning runs (benchmarks/benchmark_layer_norm.py); 0 = built-in.
int g_fwd_vecs_per_thread = 0;
int g_bwd_vecs_per_thread = 0;

layer_norm::DType to_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return layer_norm::DType::kFloat32;
    case at::kHalf: return layer_norm::DType::kFloat16;
    case at::kBFloat16: return layer_norm::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "dropout_layer_norm: ", name,
                  " must be float32, float16 or bfloat16, got ", t);
  }
  return layer_norm::DType::kFloat32;
}

// The one check every tensor argument goes through. `vector_aligned`: the kernels move it in
// 16-byte (8-byte for masks) vectors, so its start must be aligned to that.
void check_tensor(const Tensor& t, const char* name, const at::Device& device,
                  at::ScalarType dtype, at::IntArrayRef shape, int alignment = 16) {
  TORCH_CHECK(t.is_cuda(), "dropout_layer_norm: ", name, " must be a CUDA tensor, got device ",
              t.device());
  TORCH_CHECK(t.device() == device, "dropout_layer_norm: ", name, " must be on ", device,
              " like the input, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "dropout_layer_norm: ", name, " must have dtype ", dtype,
              ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, "dropout_layer_norm: ", name, " must have shape ", shape,
              ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "dropout_layer_norm: ", name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % alignment == 0, "dropout_layer_norm: ",
              name, " must start on a ", alignment, "-byte boundary (pass a fresh copy)");
}

void check_opt(const OptTensor& t, const char* name, const at::Device& device,
               at::ScalarType dtype, at::IntArrayRef shape, int alignment = 16) {
  if (t.has_value()) check_tensor(*t, name, device, dtype, shape, alignment);
}

template <typename T> const void* ptr_or_null(const std::optional<T>& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

void check_hidden_size(int64_t cols, const char* name) {
  TORCH_CHECK(cols > 0 && cols % 8 == 0 && cols <= layer_norm::kMaxCols, "dropout_layer_norm: ",
              name, " must be a positive multiple of 8 of at most ", layer_norm::kMaxCols,
              ", got ", cols);
}

// The dtypes allowed next to input dtype `itype` (the header comment's table). The kernels are
// compiled for exactly these: run_fwd_for_input / run_bwd_for_input, whose 16-bit weight type is
// layer_norm::Weight16 (ln_utils.cuh).
std::vector<at::ScalarType> residual_dtypes(at::ScalarType itype) {
  if (itype == at::kFloat) return {at::kFloat};
  return {itype, at::kFloat};
}

std::vector<at::ScalarType> weight_dtypes(at::ScalarType itype) {
  if (itype == at::kFloat) return {at::kFloat, at::kHalf};
  return {itype, at::kFloat};
}

void check_dtype_pair(at::ScalarType itype, at::ScalarType t,
                      const std::vector<at::ScalarType>& allowed, const char* name) {
  for (const auto a : allowed) {
    if (t == a) return;
  }
  std::string names;
  for (const auto a : allowed) {
    if (!names.empty()) names += " or ";
    names += c10::toString(a);
  }
  TORCH_CHECK(false, "dropout_layer_norm: ", name, " must have dtype ", names, " with ", itype,
              " input, got ", t);
}

void check_dropout_p(double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0,
              "dropout_layer_norm: dropout_p must be in [0, 1), got ", dropout_p);
}

layer_norm::PhiloxArgs philox_args(std::optional<at::Generator> gen_, const at::Device& device) {
  auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      gen_, at::cuda::detail::getDefaultCUDAGenerator(device.index()));
  at::PhiloxCudaState state;
  {
    // See PyTorch's note [Acquire lock when using random generators]. Every element's draw uses
    // the same offset (the counter carries the element index), so one step of 4 suffices.
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(4);
  }
  layer_norm::PhiloxArgs args;
  if (state.captured_) {
    args.captured = true;
    args.seed_ptr = state.seed_.ptr;
    args.offset_ptr = state.offset_.ptr;
    args.offset_intragraph = state.offset_intragraph_;
  } else {
    args.seed = state.seed_.val;
    args.offset = state.offset_.val;
  }
  return args;
}

// Forward of both entry points. Returns {z, z1, x, dmask, dmask1, mu, rsigma}; undefined tensors
// read as None in Python.
std::vector<Tensor> fwd_impl(const Tensor& x0, const OptTensor& x1_, const OptTensor& residual_,
                             const Tensor& gamma, const OptTensor& beta_,
                             const OptTensor& gamma1_, const OptTensor& beta1_,
                             const OptTensor& rowscale_, const OptTensor& colscale_,
                             const OptTensor& x0_subset_, const OptTensor& z_subset_,
                             double dropout_p, double epsilon, double rowscale_const,
                             int64_t z_numrows, std::optional<at::Generator> gen_,
                             bool residual_in_fp32, bool is_rms_norm) {
  TORCH_CHECK(x0.dim() == 2, "dropout_layer_norm: x0 must be 2-D (rows, hidden_size), got shape ",
              x0.sizes());
  const at::Device device = x0.device();
  const auto itype = x0.scalar_type();
  to_dtype(itype, "x0");
  const int64_t cols = x0.size(1);
  check_hidden_size(cols, "hidden_size (x0.size(1))");
  const bool subset = x0_subset_.has_value();
  TORCH_CHECK(subset == z_subset_.has_value(),
              "dropout_layer_norm: x0_subset and z_subset must be given together");
  const int64_t rows = subset ? x0_subset_->size(0) : x0.size(0);
  check_tensor(x0, "x0", device, itype, {x0.size(0), cols});

  const auto rtype = residual_.has_value() ? residual_->scalar_type()
                                           : (residual_in_fp32 ? at::kFloat : itype);
  check_dtype_pair(itype, rtype, residual_dtypes(itype), "residual");
  const auto wtype = gamma.scalar_type();
  check_dtype_pair(itype, wtype, weight_dtypes(itype), "gamma");
  check_tensor(gamma, "gamma", device, wtype, {cols});
  check_opt(beta_, "beta", device, wtype, {cols});
  check_opt(gamma1_, "gamma1", device, wtype, {cols});
  check_opt(beta1_, "beta1", device, wtype, {cols});
  check_opt(x1_, "x1", device, itype, {rows, cols});
  check_opt(residual_, "residual", device, rtype, {rows, cols});
  check_opt(rowscale_, "rowscale", device, itype, {rows}, 1);
  check_opt(colscale_, "colscale", device, wtype, {cols});
  check_opt(x0_subset_, "x0_subset", device, at::kInt, {rows}, 1);
  check_opt(z_subset_, "z_subset", device, at::kInt, {rows}, 1);
  TORCH_CHECK(!subset || z_numrows >= 0, "dropout_layer_norm: z_numrows must be >= 0, got ",
              z_numrows);
  check_dropout_p(dropout_p);
  TORCH_CHECK(epsilon >= 0.0, "dropout_layer_norm: epsilon must be >= 0, got ", epsilon);

  c10::cuda::CUDAGuard device_guard{device};
  const auto opts = x0.options();
  const bool save_x = residual_.has_value() || x1_.has_value() || dropout_p > 0.0 ||
                      rowscale_.has_value() || colscale_.has_value() || subset || itype != rtype;
  Tensor x, dmask, dmask1, z1;
  if (save_x) x = at::empty({rows, cols}, opts.dtype(rtype));
  if (dropout_p > 0.0) {
    dmask = at::empty(x0.sizes(), opts.dtype(at::kByte));
    if (x1_.has_value()) dmask1 = at::empty(x0.sizes(), opts.dtype(at::kByte));
  }
  Tensor z = at::empty({subset ? z_numrows : rows, cols}, opts);
  if (gamma1_.has_value()) z1 = at::empty({rows, cols}, opts);
  Tensor mu = at::empty({rows}, opts.dtype(at::kFloat));
  Tensor rsigma = at::empty({rows}, opts.dtype(at::kFloat));

  layer_norm::FwdParams p;
  p.rows = rows;
  p.cols = static_cast<int>(cols);
  p.itype = to_dtype(itype, "x0");
  p.rtype = to_dtype(rtype, "residual");
  p.wtype = to_dtype(wtype, "gamma");
  p.x0 = x0.data_ptr();
  p.x1 = ptr_or_null(x1_);
  p.residual = ptr_or_null(residual_);
  p.gamma = gamma.data_ptr();
  p.beta = ptr_or_null(beta_);
  p.gamma1 = ptr_or_null(gamma1_);
  p.beta1 = ptr_or_null(beta1_);
  p.rowscale = ptr_or_null(rowscale_);
  p.colscale = ptr_or_null(colscale_);
  p.x0_subset = subset ? x0_subset_->data_ptr<int32_t>() : nullptr;
  p.z_subset = subset ? z_subset_->data_ptr<int32_t>() : nullptr;
  p.z = z.data_ptr();
  p.z1 = z1.defined() ? z1.data_ptr() : nullptr;
  p.x = save_x ? x.data_ptr() : nullptr;
  p.dmask = dmask.defined() ? dmask.data_ptr<uint8_t>() : nullptr;
  p.dmask1 = dmask1.defined() ? dmask1.data_ptr<uint8_t>() : nullptr;
  p.mu = mu.data_ptr<float>();
  p.rs = rsigma.data_ptr<float>();
  p.epsilon = static_cast<float>(epsilon);
  p.dropout_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  // Keep when a uniform 32-bit draw is below (1 - p) * 2^32.
  const double threshold = (1.0 - dropout_p) * 4294967296.0;
  p.keep_threshold = threshold >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(threshold);
  p.rowscale_const = static_cast<float>(rowscale_const);
  p.is_rms_norm = is_rms_norm;
  p.vecs_per_thread = g_fwd_vecs_per_thread;
  if (dropout_p > 0.0) p.philox = philox_args(gen_, device);

  if (rows > 0) {
    layer_norm::run_fwd(p, c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {z, z1, x, dmask, dmask1, mu, rsigma};
}

// Backward of both entry points. Returns {dx0, dx1, dresidual, dgamma, dbeta, dgamma1, dbeta1,
// dgamma_part, dbeta_part, dgamma1_part, dbeta1_part, dcolscale, dcolscale_part}.
std::vector<Tensor> bwd_impl(const Tensor& dz, const OptTensor& dz1_, const OptTensor& dx_,
                             const Tensor& x, const OptTensor& x0_, const OptTensor& dmask_,
                             const OptTensor& dmask1_, const Tensor& mu, const Tensor& rsigma,
                             const Tensor& gamma, const OptTensor& gamma1_,
                             const OptTensor& rowscale_, const OptTensor& colscale_,
                             const OptTensor& x0_subset_, const OptTensor& z_subset_,
                             double dropout_p, double rowscale_const, int64_t x0_numrows,
                             bool has_x1, bool has_residual, bool is_rms_norm) {
  TORCH_CHECK(x.dim() == 2, "dropout_layer_norm: x must be 2-D (rows, hidden_size), got shape ",
              x.sizes());
  TORCH_CHECK(dz.dim() == 2, "dropout_layer_norm: dz must be 2-D (rows, hidden_size), got shape ",
              dz.sizes());
  const at::Device device = x.device();
  const int64_t rows = x.size(0), cols = x.size(1);
  check_hidden_size(cols, "hidden_size (x.size(1))");
  const auto itype = dz.scalar_type();
  to_dtype(itype, "dz");
  const auto rtype = x.scalar_type();
  check_dtype_pair(itype, rtype, residual_dtypes(itype), "x");
  const auto wtype = gamma.scalar_type();
  check_dtype_pair(itype, wtype, weight_dtypes(itype), "gamma");
  const bool subset = x0_subset_.has_value();
  TORCH_CHECK(subset == z_subset_.has_value(),
              "dropout_layer_norm: x0_subset and z_subset must be given together");
  const int64_t x0_rows = subset ? x0_numrows : rows;
  TORCH_CHECK(x0_rows >= 0, "dropout_layer_norm: x0_numrows must be >= 0, got ", x0_rows);
  check_dropout_p(dropout_p);

  check_tensor(x, "x", device, rtype, {rows, cols});
  check_tensor(dz, "dz", device, itype, {subset ? dz.size(0) : rows, cols});
  check_tensor(mu, "mu", device, at::kFloat, {rows}, 1);
  check_tensor(rsigma, "rsigma", device, at::kFloat, {rows}, 1);
  check_tensor(gamma, "gamma", device, wtype, {cols});
  check_opt(dx_, "dx", device, rtype, {rows, cols});
  check_opt(dz1_, "dz1", device, itype, {rows, cols});
  TORCH_CHECK(!dz1_.has_value() || gamma1_.has_value(),
              "dropout_layer_norm: gamma1 is required with dz1");
  if (dz1_.has_value()) check_opt(gamma1_, "gamma1", device, wtype, {cols});
  if (dropout_p > 0.0) {
    TORCH_CHECK(dmask_.has_value(), "dropout_layer_norm: dmask is required when dropout_p > 0");
    check_opt(dmask_, "dmask", device, at::kByte, {x0_rows, cols}, 8);
    if (has_x1) {
      TORCH_CHECK(dmask1_.has_value(),
                  "dropout_layer_norm: dmask1 is required when dropout_p > 0 and has_x1");
      check_opt(dmask1_, "dmask1", device, at::kByte, {rows, cols}, 8);
    }
  }
  check_opt(rowscale_, "rowscale", device, itype, {rows}, 1);
  check_opt(colscale_, "colscale", device, wtype, {cols});
  if (colscale_.has_value()) {
    TORCH_CHECK(x0_.has_value(), "dropout_layer_norm: x0 is required for the gradient of colscale");
    check_opt(x0_, "x0", device, itype, {x0_rows, cols});
  }
  check_opt(x0_subset_, "x0_subset", device, at::kInt, {rows}, 1);
  check_opt(z_subset_, "z_subset", device, at::kInt, {rows}, 1);

  c10::cuda::CUDAGuard device_guard{device};
  const auto opts = x.options();
  Tensor dx0 = at::empty({x0_rows, cols}, opts.dtype(itype));
  Tensor dx1, dresidual, dgamma1, dbeta1, dcolscale;
  if (has_x1) dx1 = at::empty({rows, cols}, opts.dtype(itype));
  if (has_residual) dresidual = at::empty({rows, cols}, opts.dtype(rtype));
  Tensor dgamma = at::empty_like(gamma);
  Tensor dbeta = at::empty_like(gamma);
  if (dz1_.has_value()) {
    dgamma1 = at::empty_like(gamma);
    dbeta1 = at::empty_like(gamma);
  }
  if (colscale_.has_value()) dcolscale = at::empty_like(*colscale_);

  layer_norm::BwdParams p;
  p.rows = rows;
  p.cols = static_cast<int>(cols);
  p.itype = to_dtype(itype, "dz");
  p.rtype = to_dtype(rtype, "x");
  p.wtype = to_dtype(wtype, "gamma");
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, device.index()));
  p.dz = dz.data_ptr();
  p.dz1 = ptr_or_null(dz1_);
  p.dx = ptr_or_null(dx_);
  p.x = x.data_ptr();
  p.x0 = colscale_.has_value() ? x0_->data_ptr() : nullptr;
  p.dmask = dropout_p > 0.0 ? dmask_->data_ptr<uint8_t>() : nullptr;
  p.dmask1 = dropout_p > 0.0 && has_x1 ? dmask1_->data_ptr<uint8_t>() : nullptr;
  p.mu = mu.data_ptr<float>();
  p.rs = rsigma.data_ptr<float>();
  p.gamma = gamma.data_ptr();
  p.gamma1 = dz1_.has_value() ? gamma1_->data_ptr() : nullptr;
  p.rowscale = ptr_or_null(rowscale_);
  p.colscale = ptr_or_null(colscale_);
  p.x0_subset = subset ? x0_subset_->data_ptr<int32_t>() : nullptr;
  p.z_subset = subset ? z_subset_->data_ptr<int32_t>() : nullptr;
  p.dx0 = dx0.data_ptr();
  p.dx1 = has_x1 ? dx1.data_ptr() : nullptr;
  p.dresidual = has_residual ? dresidual.data_ptr() : nullptr;
  p.dgamma = dgamma.data_ptr();
  p.dbeta = dbeta.data_ptr();
  p.dgamma1 = dgamma1.defined() ? dgamma1.data_ptr() : nullptr;
  p.dbeta1 = dbeta1.defined() ? dbeta1.data_ptr() : nullptr;
  p.dcolscale = dcolscale.defined() ? dcolscale.data_ptr() : nullptr;
  p.dropout_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  p.rowscale_const = static_cast<float>(rowscale_const);
  p.is_rms_norm = is_rms_norm;
  p.vecs_per_thread = g_bwd_vecs_per_thread;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int num_parts = layer_norm::run_bwd(p, stream, /*launch=*/false);
  const auto fopts = opts.dtype(at::kFloat);
  Tensor dgamma_part = at::empty({num_parts, cols}, fopts);
  Tensor dbeta_part = at::empty({num_parts, cols}, fopts);
  Tensor dgamma1_part, dbeta1_part, dcolscale_part;
  if (dz1_.has_value()) {
    dgamma1_part = at::empty({num_parts, cols}, fopts);
    dbeta1_part = at::empty({num_parts, cols}, fopts);
  }
  if (colscale_.has_value()) dcolscale_part = at::empty({num_parts, cols}, fopts);
  p.dgamma_part = dgamma_part.data_ptr<float>();
  p.dbeta_part = dbeta_part.data_ptr<float>();
  p.dgamma1_part = dgamma1_part.defined() ? dgamma1_part.data_ptr<float>() : nullptr;
  p.dbeta1_part = dbeta1_part.defined() ? dbeta1_part.data_ptr<float>() : nullptr;
  p.dcolscale_part = dcolscale_part.defined() ? dcolscale_part.data_ptr<float>() : nullptr;
  layer_norm::run_bwd(p, stream, /*launch=*/true);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx0,         dx1,        dresidual,    dgamma,      dbeta,     dgamma1,       dbeta1,
          dgamma_part, dbeta_part, dgamma1_part, dbeta1_part, dcolscale, dcolscale_part};
}

}  // namespace

std::vector<Tensor> dropout_add_ln_fwd(const Tensor& x0, const OptTensor& residual_,
                                       const Tensor& gamma, const OptTensor& beta_,
                                       const OptTensor& rowscale_, const OptTensor& colscale_,
                                       const OptTensor& x0_subset_, const OptTensor& z_subset_,
                                       double dropout_p, double epsilon, double rowscale_const,
                                       int64_t z_numrows, std::optional<at::Generator> gen_,
                                       bool residual_in_fp32, bool is_rms_norm) {
  auto out = fwd_impl(x0, std::nullopt, residual_, gamma, beta_, std::nullopt, std::nullopt,
                      rowscale_, colscale_, x0_subset_, z_subset_, dropout_p, epsilon,
                      rowscale_const, z_numrows, gen_, residual_in_fp32, is_rms_norm);
  return {out[0], out[2], out[3], out[5], out[6]};  // z, x, dmask, mu, rsigma
}

std::vector<Tensor> dropout_add_ln_bwd(const Tensor& dz, const OptTensor& dx_, const Tensor& x,
                                       const OptTensor& x0_, const OptTensor& dmask_,
                                       const Tensor& mu, const Tensor& rsigma, const Tensor& gamma,
                                       const OptTensor& rowscale_, const OptTensor& colscale_,
                                       const OptTensor& x0_subset_, const OptTensor& z_subset_,
                                       double dropout_p, double rowscale_const,
                                       int64_t x0_numrows, bool has_residual, bool is_rms_norm) {
  auto g = bwd_impl(dz, std::nullopt, dx_, x, x0_, dmask_, std::nullopt, mu, rsigma, gamma,
                    std::nullopt, rowscale_, colscale_, x0_subset_, z_subset_, dropout_p,
                    rowscale_const, x0_numrows, /*has_x1=*/false, has_residual, is_rms_norm);
  std::vector<Tensor> result = {g[0], g[2], g[3], g[4], g[7], g[8]};
  if (colscale_.has_value()) {
    result.push_back(g[11]);
    result.push_back(g[12]);
  }
  return result;  // dx0, dresidual, dgamma, dbeta, dgamma_part, dbeta_part[, dcolscale, part]
}

std::vector<Tensor> dropout_add_ln_parallel_residual_fwd(
    const Tensor& x0, const OptTensor& x1_, const OptTensor& residual_, const Tensor& gamma0,
    const OptTensor& beta0_, const OptTensor& gamma1_, const OptTensor& beta1_, double dropout_p,
    double epsilon, std::optional<at::Generator> gen_, bool residual_in_fp32, bool is_rms_norm) {
  auto out = fwd_impl(x0, x1_, residual_, gamma0, beta0_, gamma1_, beta1_, std::nullopt,
                      std::nullopt, std::nullopt, std::nullopt, dropout_p, epsilon, 1.0, 0, gen_,
                      residual_in_fp32, is_rms_norm);
  return out;  // z0, z1, x, dmask0, dmask1, mu, rsigma
}

std::vector<Tensor> dropout_add_ln_parallel_residual_bwd(
    const Tensor& dz0, const OptTensor& dz1_, const OptTensor& dx_, const Tensor& x,
    const OptTensor& dmask0_, const OptTensor& dmask1_, const Tensor& mu, const Tensor& rsigma,
    const Tensor& gamma0, const OptTensor& gamma1_, double dropout_p, bool has_x1,
    bool has_residual, bool is_rms_norm) {
  auto g = bwd_impl(dz0, dz1_, dx_, x, std::nullopt, dmask0_, dmask1_, mu, rsigma, gamma0,
                    gamma1_, std::nullopt, std::nullopt, std::nullopt, std::nullopt, dropout_p,
                    1.0, 0, has_x1, has_residual, is_rms_norm);
  g.resize(11);  // dx0, dx1, dresidual, dgamma0, dbeta0, dgamma1, dbeta1, and the four parts
  return g;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused dropout + residual + LayerNorm / RMSNorm (forward and backward)";
  m.def("dropout_add_ln_fwd", &dropout_add_ln_fwd, "Dropout + add + LayerNorm forward",
        py::arg("x0"), py::arg("residual"), py::arg("gamma"), py::arg("beta_"),
        py::arg("rowscale_"), py::arg("colscale_"), py::arg("x0_subset_"), py::arg("z_subset_"),
        py::arg("dropout_p"), py::arg("epsilon"), py::arg("rowscale_const"),
        py::arg("z_numrows"), py::arg("gen_"), py::arg("residual_in_fp32") = false,
        py::arg("is_rms_norm") = false);
  m.def("dropout_add_ln_bwd", &dropout_add_ln_bwd, "Dropout + add + LayerNorm backward",
        py::arg("dz"), py::arg("dx_"), py::arg("x"), py::arg("x0_"), py::arg("dmask_"),
        py::arg("mu"), py::arg("rsigma"), py::arg("gamma"), py::arg("rowscale_"),
        py::arg("colscale_"), py::arg("x0_subset_"), py::arg("z_subset_"), py::arg("dropout_p"),
        py::arg("rowscale_const"), py::arg("x0_numrows"), py::arg("has_residual"),
        py::arg("is_rms_norm") = false);
  m.def("dropout_add_ln_parallel_residual_fwd", &dropout_add_ln_parallel_residual_fwd,
        "Dropout + add + LayerNorm forward, parallel residual (two inputs, two outputs)",
        py::arg("x0"), py::arg("x1_"), py::arg("residual"), py::arg("gamma0"), py::arg("beta0_"),
        py::arg("gamma1_"), py::arg("beta1_"), py::arg("dropout_p"), py::arg("epsilon"),
        py::arg("gen_"), py::arg("residual_in_fp32") = false, py::arg("is_rms_norm") = false);
  m.def("dropout_add_ln_parallel_residual_bwd", &dropout_add_ln_parallel_residual_bwd,
        "Dropout + add + LayerNorm backward, parallel residual", py::arg("dz0"), py::arg("dz1_"),
        py::arg("dx_"), py::arg("x"), py::arg("dmask0_"), py::arg("dmask1_"), py::arg("mu"),
        py::arg("rsigma"), py::arg("gamma0"), py::arg("gamma1_"), py::arg("dropout_p"),
        py::arg("has_x1"), py::arg("has_residual"), py::arg("is_rms_norm") = false);
  m.def(
      "_set_vecs_per_thread",
      [](int fwd, int bwd) {
        g_fwd_vecs_per_thread = fwd;
        g_bwd_vecs_per_thread = bwd;
      },
      "Tuning hook: vectors of 8 elements per thread for the forward (1, 2, 4) and backward "
      "(1, 2) kernels; 0 restores the built-in choice",
      py::arg("fwd"), py::arg("bwd"));
}
