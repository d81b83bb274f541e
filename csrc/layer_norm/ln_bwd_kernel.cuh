// Backward kernel: a persistent grid; each row slot of a block walks rows with a grid stride and
// keeps its columns' dgamma / dbeta (and dgamma1 / dbeta1 / dcolscale) sums in registers, then
// writes them as one partial-sum row. A second small kernel adds the partial rows up.
#pragma once

#include "ln_utils.cuh"

namespace layer_norm {

constexpr int kBwdMinThreads = 256;
constexpr int kBwdMaxThreads = 512;

// kExtra: the rarer sums (dgamma1 / dbeta1 of the parallel form, dcolscale) get their own
// instantiation so the common case does not pay their registers.
template <typename I, typename R, typename W, int NV, bool kExtra>
__global__ void __launch_bounds__(kBwdMaxThreads) ln_bwd_kernel(const BwdParams p) {
  __shared__ float smem[2 * kBwdMaxThreads / 32];
  const int tpr = blockDim.x;
  const int vecs = p.cols / kEltsPerVec;
  const float inv_cols = 1.f / p.cols;
  const bool dropout = p.dmask != nullptr;

  float dg[NV][kEltsPerVec], db[NV][kEltsPerVec];
  float dg1[NV][kEltsPerVec], db1[NV][kEltsPerVec];
  float dcs[NV][kEltsPerVec];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
#pragma unroll
    for (int j = 0; j < kEltsPerVec; ++j) {
      dg[i][j] = db[i][j] = 0.f;
      if (kExtra) dg1[i][j] = db1[i][j] = dcs[i][j] = 0.f;
    }
  }

  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < p.rows;
       base += stride) {
    const int64_t row = base + threadIdx.y;
    const bool row_ok = row < p.rows;
    const RowSource src = row_source<I>(p, row, row_ok);
    const int64_t row_x0 = src.row_x0, row_z = src.row_z;
    const bool has_x0 = src.has_x0, has_z = src.has_z;
    const float scale = src.scale;
    const float mu = row_ok ? p.mu[row] : 0.f;
    const float rs = row_ok ? p.rs[row] : 0.f;

    // Issue every global load of the row before any arithmetic.
    Pack<R> xv[NV], dxv[NV];
    Pack<I> dzv[NV], dz1v[NV], x0v[NV];
    MaskPack m0[NV], m1[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = threadIdx.x + i * tpr;
      const int64_t col = static_cast<int64_t>(c) * kEltsPerVec;
      xv[i].zero();
      dxv[i].zero();
      dzv[i].zero();
      m0[i].w = m1[i].w = make_uint2(0, 0);
      if (kExtra) {
        dz1v[i].zero();
        x0v[i].zero();
      }
      if (c < vecs) {
        if (row_ok) xv[i].load(p.x, row * p.cols + col);
        if (has_z) dzv[i].load(p.dz, row_z * p.cols + col);
        if (row_ok && p.dx != nullptr) dxv[i].load(p.dx, row * p.cols + col);
        if (dropout && has_x0) m0[i].load(p.dmask, row_x0 * p.cols + col);
        if (dropout && row_ok && p.dmask1 != nullptr) m1[i].load(p.dmask1, row * p.cols + col);
        if (kExtra && row_ok && p.dz1 != nullptr) dz1v[i].load(p.dz1, row * p.cols + col);
        if (kExtra && has_x0 && p.colscale != nullptr) x0v[i].load(p.x0, row_x0 * p.cols + col);
      }
    }

    // dy = dz * gamma (+ dz1 * gamma1); the row sums of dy and dy * xhat drive the gradient.
    float xhat[NV][kEltsPerVec], dy[NV][kEltsPerVec];
    float sums[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = threadIdx.x + i * tpr;
      const int64_t col = static_cast<int64_t>(c) * kEltsPerVec;
      Pack<W> g, g1;
      if (c < vecs) g.load(p.gamma, col); else g.zero();
      if (kExtra && c < vecs && p.dz1 != nullptr) g1.load(p.gamma1, col); else g1.zero();
#pragma unroll
      for (int j = 0; j < kEltsPerVec; ++j) {
        const float xh = p.is_rms_norm ? xv[i].get(j) * rs : (xv[i].get(j) - mu) * rs;
        const float dzj = dzv[i].get(j);
        float d = dzj * g.get(j);
        dg[i][j] += dzj * xh;
        db[i][j] += dzj;
        if (kExtra) {
          const float dz1j = dz1v[i].get(j);
          d += dz1j * g1.get(j);
          dg1[i][j] += dz1j * xh;
          db1[i][j] += dz1j;
        }
        xhat[i][j] = xh;
        dy[i][j] = d;
        sums[0] += d;
        sums[1] += d * xh;
      }
    }
    row_allreduce(sums, tpr, smem);
    const float mean_dy = p.is_rms_norm ? 0.f : sums[0] * inv_cols;
    const float mean_dy_xhat = sums[1] * inv_cols;

#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = threadIdx.x + i * tpr;
      if (c >= vecs || !row_ok) continue;
      const int64_t col = static_cast<int64_t>(c) * kEltsPerVec;
      Pack<W> cs;
      if (kExtra && p.colscale != nullptr) cs.load(p.colscale, col);
      Pack<R> dres;
      Pack<I> d0, d1;
#pragma unroll
      for (int j = 0; j < kEltsPerVec; ++j) {
        const float dt =
            rs * (dy[i][j] - mean_dy_xhat * xhat[i][j] - mean_dy) + dxv[i].get(j);
        dres.set(j, dt);
        // Gradient through dropout(x0 * scale * colscale).
        float f = dt * scale;
        if (dropout) f = m0[i].e[j] ? f * p.dropout_scale : 0.f;
        if (kExtra && p.colscale != nullptr) {
          dcs[i][j] += f * x0v[i].get(j);
          f *= cs.get(j);
        }
        d0.set(j, f);
        float f1 = dt;
        if (dropout && p.dmask1 != nullptr) f1 = m1[i].e[j] ? f1 * p.dropout_scale : 0.f;
        d1.set(j, f1);
      }
      if (p.dresidual != nullptr) dres.store(p.dresidual, row * p.cols + col);
      if (has_x0) d0.store(p.dx0, row_x0 * p.cols + col);
      if (p.dx1 != nullptr) d1.store(p.dx1, row * p.cols + col);
    }
  }

  // One partial-sum row per row slot.
  const int64_t part = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = threadIdx.x + i * tpr;
    if (c >= vecs) continue;
    const int64_t off = part * p.cols + static_cast<int64_t>(c) * kEltsPerVec;
    Pack<float> a, b;
#pragma unroll
    for (int j = 0; j < kEltsPerVec; ++j) { a.e[j] = dg[i][j]; b.e[j] = db[i][j]; }
    a.store(p.dgamma_part, off);
    b.store(p.dbeta_part, off);
    if (kExtra) {
      if (p.dgamma1_part != nullptr) {
#pragma unroll
        for (int j = 0; j < kEltsPerVec; ++j) { a.e[j] = dg1[i][j]; b.e[j] = db1[i][j]; }
        a.store(p.dgamma1_part, off);
        b.store(p.dbeta1_part, off);
      }
      if (p.dcolscale_part != nullptr) {
#pragma unroll
        for (int j = 0; j < kEltsPerVec; ++j) a.e[j] = dcs[i][j];
        a.store(p.dcolscale_part, off);
      }
    }
  }
}

// Column sums of up to five [num_parts, cols] fp32 buffers (blockIdx.y picks one), written in
// the weight dtype. Each thread adds a strided set of part rows for 4 columns; the block's
// 16 row lanes are then combined through shared memory, in a fixed order (deterministic).
struct PartsToReduce {
  const float* part[5];
  void* out[5];
};

constexpr int kReduceCols4 = 16, kReduceRows = 16;

template <typename W>
__global__ void __launch_bounds__(kReduceCols4 * kReduceRows)
ln_reduce_parts_kernel(const PartsToReduce r, int num_parts, int cols) {
  __shared__ float4 smem[kReduceRows][kReduceCols4];
  // Select with constant indices: a dynamic index into the kernel parameters would copy them
  // to local memory.
  const float* part = r.part[0];
  void* out_ptr = r.out[0];
#pragma unroll
  for (int k = 1; k < 5; ++k) {
    if (blockIdx.y == k) { part = r.part[k]; out_ptr = r.out[k]; }
  }
  const int col = (blockIdx.x * kReduceCols4 + threadIdx.x) * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (col < cols) {
    for (int k = threadIdx.y; k < num_parts; k += kReduceRows) {
      const float* src = part + static_cast<int64_t>(k) * cols + col;
      const float4 v = __ldg(reinterpret_cast<const float4*>(src));
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
  }
  smem[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int k = 1; k < kReduceRows; ++k) {
      const float4 v = smem[k][threadIdx.x];
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
    using Bits = typename TypeInfo<W>::Bits;
    Bits* out = static_cast<Bits*>(out_ptr) + col;
    out[0] = TypeInfo<W>::from_float(acc.x);
    out[1] = TypeInfo<W>::from_float(acc.y);
    out[2] = TypeInfo<W>::from_float(acc.z);
    out[3] = TypeInfo<W>::from_float(acc.w);
  }
}

// One vector per thread up to 2048 columns, two beyond (at most 512 threads per row): few enough
// registers for two blocks of 256 threads per SM with the dgamma / dbeta sums held in registers.
inline int bwd_vecs_per_thread(const BwdParams& p) {
  const int vecs = p.cols / kEltsPerVec;
  const int nv = p.vecs_per_thread;  // tuning override, used when it fits the block
  if ((nv == 1 || nv == 2) && next_pow2(ceil_div(vecs, nv)) <= kBwdMaxThreads) return nv;
  return vecs <= 256 ? 1 : 2;
}

template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error; fall back to one block per SM
    n = 1;
  }
  return n < 1 ? 1 : n;
}

template <typename I, typename R, typename W, int NV, bool kExtra>
int launch_bwd_kernel(const BwdParams& p, cudaStream_t stream, bool launch) {
  const int tpr = next_pow2(ceil_div(p.cols / kEltsPerVec, NV));
  const dim3 block(tpr, tpr >= kBwdMinThreads ? 1 : kBwdMinThreads / tpr);
  auto kernel = ln_bwd_kernel<I, R, W, NV, kExtra>;
  // Occupancy depends on the instantiation and the block size (256 or 512 threads): ask the
  // runtime once for each. A race here is benign: every caller computes the same value.
  const int threads = block.x * block.y;
  static int cached_per_sm[2] = {0, 0};
  int& per_sm_blocks = cached_per_sm[threads == kBwdMaxThreads ? 1 : 0];
  if (per_sm_blocks == 0) per_sm_blocks = blocks_per_sm(kernel, threads);
  const int64_t row_blocks = (p.rows + block.y - 1) / block.y;
  const int64_t cap = static_cast<int64_t>(p.num_sms) * per_sm_blocks;
  const int grid = static_cast<int>(row_blocks < 1 ? 1 : (row_blocks < cap ? row_blocks : cap));
  const int num_parts = grid * block.y;
  if (!launch) return num_parts;
  kernel<<<grid, block, 0, stream>>>(p);

  PartsToReduce r{};
  int n = 0;
  const auto add = [&](const float* part, void* out) {
    if (part != nullptr && out != nullptr) { r.part[n] = part; r.out[n] = out; ++n; }
  };
  add(p.dgamma_part, p.dgamma);
  add(p.dbeta_part, p.dbeta);
  add(p.dgamma1_part, p.dgamma1);
  add(p.dbeta1_part, p.dbeta1);
  add(p.dcolscale_part, p.dcolscale);
  const dim3 rgrid(ceil_div(p.cols, 4 * kReduceCols4), n);
  ln_reduce_parts_kernel<W><<<rgrid, dim3(kReduceCols4, kReduceRows), 0, stream>>>(r, num_parts,
                                                                                    p.cols);
  return num_parts;
}

template <typename I, typename R, typename W>
int launch_bwd(const BwdParams& p, cudaStream_t stream, bool launch) {
  const bool extra = p.dz1 != nullptr || p.colscale != nullptr;
  const int nv = bwd_vecs_per_thread(p);
  if (nv == 1) {
    return extra ? launch_bwd_kernel<I, R, W, 1, true>(p, stream, launch)
                 : launch_bwd_kernel<I, R, W, 1, false>(p, stream, launch);
  }
  return extra ? launch_bwd_kernel<I, R, W, 2, true>(p, stream, launch)
               : launch_bwd_kernel<I, R, W, 2, false>(p, stream, launch);
}

// The instantiation table, as in the forward: the residual is I or fp32, the weights fp32 or
// Weight16<I>; dgamma / dbeta / dcolscale are written in the weight type.
template <typename I>
int run_bwd_for_input(const BwdParams& p, cudaStream_t stream, bool launch) {
  using W16 = typename Weight16<I>::Type;
  const bool r32 = p.rtype == DType::kFloat32, w32 = p.wtype == DType::kFloat32;
  if (r32 && w32) return launch_bwd<I, float, float>(p, stream, launch);
  if (r32) return launch_bwd<I, float, W16>(p, stream, launch);
  if (w32) return launch_bwd<I, I, float>(p, stream, launch);
  return launch_bwd<I, I, W16>(p, stream, launch);
}

}  // namespace layer_norm
