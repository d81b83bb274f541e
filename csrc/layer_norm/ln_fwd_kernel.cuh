// Forward kernel: one row per group of tpr threads, the whole row held in registers (NV vectors of
// 8 elements per thread), two-pass statistics in fp32, one read of every input and one write of
// every output.
#pragma once

#include "ln_utils.cuh"

namespace layer_norm {

constexpr int kFwdThreads = 256;

// I: input and output dtype, R: residual / pre-norm sum dtype, W: weight dtype. kParallel: the
// second input x1 and the second output z1 (the parallel-residual form) are compiled in; without
// it their registers are not spent.
template <typename I, typename R, typename W, int NV, bool kParallel>
__global__ void __launch_bounds__(kFwdThreads) ln_fwd_kernel(const FwdParams p) {
  __shared__ float smem[kFwdThreads / 32];
  const int tpr = blockDim.x;
  const int vecs = p.cols / kEltsPerVec;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool row_ok = row < p.rows;

  const RowSource src = row_source<I>(p, row, row_ok);
  const int64_t row_x0 = src.row_x0, row_z = src.row_z;
  const bool has_x0 = src.has_x0, has_z = src.has_z;
  const float scale = src.scale;
  const bool dropout = p.dmask != nullptr;
  PhiloxSeed seed{0, 0};
  if (dropout) seed = unpack_philox(p.philox);

  // Issue every global load of the row before any arithmetic.
  Pack<I> x0v[NV], x1v[NV];
  Pack<R> resv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = threadIdx.x + i * tpr;
    x0v[i].zero();
    x1v[i].zero();
    resv[i].zero();
    if (c < vecs) {
      const int64_t col = static_cast<int64_t>(c) * kEltsPerVec;
      if (has_x0) x0v[i].load(p.x0, row_x0 * p.cols + col);
      if (kParallel && row_ok && p.x1 != nullptr) x1v[i].load(p.x1, row * p.cols + col);
      if (row_ok && p.residual != nullptr) resv[i].load(p.residual, row * p.cols + col);
    }
  }

  float v[NV][kEltsPerVec];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = threadIdx.x + i * tpr;
    const int64_t col = static_cast<int64_t>(c) * kEltsPerVec;
    Pack<W> cs;
    if (c < vecs && p.colscale != nullptr) cs.load(p.colscale, col);
    bool keep0[kEltsPerVec], keep1[kEltsPerVec];
#pragma unroll
    for (int j = 0; j < kEltsPerVec; ++j) keep0[j] = keep1[j] = true;
    if (c < vecs && dropout) {
      if (has_x0) dropout_keep(seed, 0, row_x0 * p.cols + col, p.keep_threshold, keep0);
      if (kParallel && row_ok && p.x1 != nullptr) {
        dropout_keep(seed, kStreamX1, row * p.cols + col, p.keep_threshold, keep1);
      }
    }
    MaskPack m0, m1;
    Pack<R> xout;
#pragma unroll
    for (int j = 0; j < kEltsPerVec; ++j) {
      float a = x0v[i].get(j) * scale;
      if (p.colscale != nullptr) a *= cs.get(j);
      if (dropout) a = keep0[j] ? a * p.dropout_scale : 0.f;
      if (kParallel && p.x1 != nullptr) {
        const float b = x1v[i].get(j);
        a += dropout ? (keep1[j] ? b * p.dropout_scale : 0.f) : b;
      }
      a += resv[i].get(j);  // zero without a residual
      v[i][j] = c < vecs ? a : 0.f;
      sum += v[i][j];
      xout.set(j, a);
      m0.e[j] = keep0[j];
      m1.e[j] = keep1[j];
    }
    if (c < vecs) {
      if (row_ok && p.x != nullptr) xout.store(p.x, row * p.cols + col);
      if (dropout && has_x0) m0.store(p.dmask, row_x0 * p.cols + col);
      if (kParallel && dropout && row_ok && p.dmask1 != nullptr) {
        m1.store(p.dmask1, row * p.cols + col);
      }
    }
  }

  // Two-pass statistics from registers: mean, then the mean square about it.
  float mean = 0.f;
  if (!p.is_rms_norm) {
    float s[1] = {sum};
    row_allreduce(s, tpr, smem);
    mean = s[0] / p.cols;
  }
  float sq[1] = {0.f};
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = threadIdx.x + i * tpr;
#pragma unroll
    for (int j = 0; j < kEltsPerVec; ++j) {
      const float d = v[i][j] - mean;
      sq[0] += c < vecs ? d * d : 0.f;
    }
  }
  row_allreduce(sq, tpr, smem);
  const float rstd = rsqrtf(sq[0] / p.cols + p.epsilon);
  if (row_ok && threadIdx.x == 0) {
    p.mu[row] = mean;
    p.rs[row] = rstd;
  }

  if (!has_z) return;  // no barrier follows
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = threadIdx.x + i * tpr;
    if (c >= vecs) continue;
    const int64_t col = static_cast<int64_t>(c) * kEltsPerVec;
    Pack<W> g, b;
    g.load(p.gamma, col);
    if (p.beta != nullptr) b.load(p.beta, col); else b.zero();
    Pack<I> z;
#pragma unroll
    for (int j = 0; j < kEltsPerVec; ++j) {
      z.set(j, (v[i][j] - mean) * rstd * g.get(j) + b.get(j));
    }
    z.store(p.z, row_z * p.cols + col);
    if (kParallel && p.z1 != nullptr) {
      g.load(p.gamma1, col);
      if (p.beta1 != nullptr) b.load(p.beta1, col); else b.zero();
#pragma unroll
      for (int j = 0; j < kEltsPerVec; ++j) {
        z.set(j, (v[i][j] - mean) * rstd * g.get(j) + b.get(j));
      }
      z.store(p.z1, row_z * p.cols + col);
    }
  }
}

// Vectors per thread: enough threads per row to keep many loads in flight, few enough that a
// row's reduction stays short. Threads per row: the next power of two that covers the row.
inline int fwd_vecs_per_thread(const FwdParams& p) {
  const int vecs = p.cols / kEltsPerVec;
  const int nv = p.vecs_per_thread;  // tuning override, used when it fits the block
  if ((nv == 1 || nv == 2 || nv == 4) && next_pow2(ceil_div(vecs, nv)) <= kFwdThreads) return nv;
  return vecs <= 64 ? 1 : (vecs <= 256 ? 2 : 4);
}

template <typename I, typename R, typename W>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  const int nv = fwd_vecs_per_thread(p);
  const int tpr = next_pow2(ceil_div(p.cols / kEltsPerVec, nv));
  const dim3 block(tpr, kFwdThreads / tpr);
  const dim3 grid(ceil_div(p.rows, block.y));
  if (p.x1 != nullptr || p.z1 != nullptr) {
    if (nv == 1) ln_fwd_kernel<I, R, W, 1, true><<<grid, block, 0, stream>>>(p);
    else if (nv == 2) ln_fwd_kernel<I, R, W, 2, true><<<grid, block, 0, stream>>>(p);
    else ln_fwd_kernel<I, R, W, 4, true><<<grid, block, 0, stream>>>(p);
  } else {
    if (nv == 1) ln_fwd_kernel<I, R, W, 1, false><<<grid, block, 0, stream>>>(p);
    else if (nv == 2) ln_fwd_kernel<I, R, W, 2, false><<<grid, block, 0, stream>>>(p);
    else ln_fwd_kernel<I, R, W, 4, false><<<grid, block, 0, stream>>>(p);
  }
}

// The instantiation table: for input type I, the residual is I or fp32 and the weights are fp32
// or Weight16<I>. With fp32 input (residual fp32 too) that is two kernels: fp32 or fp16 weights.
template <typename I>
void run_fwd_for_input(const FwdParams& p, cudaStream_t stream) {
  using W16 = typename Weight16<I>::Type;
  const bool r32 = p.rtype == DType::kFloat32, w32 = p.wtype == DType::kFloat32;
  if (r32 && w32) launch_fwd<I, float, float>(p, stream);
  else if (r32) launch_fwd<I, float, W16>(p, stream);
  else if (w32) launch_fwd<I, I, float>(p, stream);
  else launch_fwd<I, I, W16>(p, stream);
}

}  // namespace layer_norm
