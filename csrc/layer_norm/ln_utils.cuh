// Device helpers of the layer-norm kernels: 8-element vectors, Philox, row reductions.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ln.h"

namespace layer_norm {

// Element storage as raw bits, so vectors can be unions of 16-byte words (fp16/bf16 types have
// constructors that unions do not allow).
template <typename T> struct TypeInfo;

template <> struct TypeInfo<float> {
  using Bits = float;
  __device__ static float to_float(Bits b) { return b; }
  __device__ static Bits from_float(float v) { return v; }
};

template <> struct TypeInfo<__half> {
  using Bits = uint16_t;
  __device__ static float to_float(Bits b) { return __half2float(__ushort_as_half(b)); }
  __device__ static Bits from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

template <> struct TypeInfo<__nv_bfloat16> {
  using Bits = uint16_t;
  __device__ static float to_float(Bits b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  __device__ static Bits from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

// The 16-bit weight type paired with input type I in flash-attn's dtype table: I itself for fp16
// / bf16 input, fp16 for fp32 input (the other weight type is always fp32). The instantiation
// tables (run_fwd_for_input / run_bwd_for_input) compile exactly these; the binding
// (weight_dtypes in ln_api.cpp) admits exactly these.
template <typename I> struct Weight16 { using Type = I; };
template <> struct Weight16<float> { using Type = __half; };

template <typename T> __device__ inline float load_scalar(const void* base, int64_t i) {
  return TypeInfo<T>::to_float(static_cast<const typename TypeInfo<T>::Bits*>(base)[i]);
}

// Which x0 row feeds row `row` of the sum and which z row it writes (token-dropping subsets:
// 1-based indices, 0 = none), and the row's scale (rowscale, or the subset's constant). Shared by
// the forward and backward kernels, whose params both carry these fields.
struct RowSource {
  int64_t row_x0, row_z;
  bool has_x0, has_z;
  float scale;
};

template <typename I, typename Params>
__device__ inline RowSource row_source(const Params& p, int64_t row, bool row_ok) {
  RowSource r{row, row, row_ok, row_ok, 1.f};
  if (!row_ok) return r;
  if (p.x0_subset != nullptr) {
    r.row_x0 = p.x0_subset[row] - 1;
    r.row_z = p.z_subset[row] - 1;
    r.has_x0 = r.row_x0 >= 0;
    r.has_z = r.row_z >= 0;
    r.scale = p.rowscale_const;
  } else if (p.rowscale != nullptr) {
    r.scale = load_scalar<I>(p.rowscale, row);
  }
  return r;
}

// kEltsPerVec consecutive elements of type T, moved with 16-byte loads and stores.
template <typename T> struct Pack {
  using Bits = typename TypeInfo<T>::Bits;
  static constexpr int kWords = sizeof(Bits) * kEltsPerVec / 16;
  union {
    uint4 w[kWords];
    Bits e[kEltsPerVec];
  };

  __device__ void zero() {
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = make_uint4(0, 0, 0, 0);
  }
  // elem: index of the first element; a multiple of kEltsPerVec, so the address is 16-byte aligned.
  __device__ void load(const void* base, int64_t elem) {
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const Bits*>(base) + elem);
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = __ldg(src + k);
  }
  __device__ void store(void* base, int64_t elem) const {
    uint4* dst = reinterpret_cast<uint4*>(static_cast<Bits*>(base) + elem);
#pragma unroll
    for (int k = 0; k < kWords; ++k) dst[k] = w[k];
  }
  __device__ float get(int j) const { return TypeInfo<T>::to_float(e[j]); }
  __device__ void set(int j, float v) { e[j] = TypeInfo<T>::from_float(v); }
};

// Keep mask of kEltsPerVec elements, one byte each (the uint8 dmask layout).
struct MaskPack {
  union {
    uint2 w;
    uint8_t e[kEltsPerVec];
  };
  __device__ void load(const uint8_t* base, int64_t elem) {
    w = __ldg(reinterpret_cast<const uint2*>(base + elem));
  }
  __device__ void store(uint8_t* base, int64_t elem) const {
    *reinterpret_cast<uint2*>(base + elem) = w;
  }
};

// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
// Counter = (group of 4 elements, launch offset): every element of a tensor gets its own draw,
// independent of the launch configuration, and each call takes a fresh offset from PyTorch's
// generator.
__device__ inline uint4 philox(uint64_t seed, uint64_t group, uint64_t offset) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  uint4 c = make_uint4(static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
                       static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32));
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t lo0 = kM0 * c.x, hi0 = __umulhi(kM0, c.x);
    const uint32_t lo1 = kM1 * c.z, hi1 = __umulhi(kM1, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

struct PhiloxSeed {
  uint64_t seed, offset;
};

__device__ inline PhiloxSeed unpack_philox(const PhiloxArgs& args) {
  if (args.captured) {
    return {static_cast<uint64_t>(*args.seed_ptr),
            static_cast<uint64_t>(*args.offset_ptr) + args.offset_intragraph};
  }
  return {args.seed, args.offset};
}

// The two stream ids keep x0's and x1's masks independent in the parallel-residual form.
constexpr uint64_t kStreamX1 = uint64_t(1) << 63;

// keep[j] for the kEltsPerVec elements starting at `elem` (a multiple of kEltsPerVec).
__device__ inline void dropout_keep(const PhiloxSeed& s, uint64_t stream, int64_t elem,
                                    uint32_t threshold, bool (&keep)[kEltsPerVec]) {
  const uint64_t group = (static_cast<uint64_t>(elem) >> 2) | stream;
  const uint4 a = philox(s.seed, group, s.offset);
  const uint4 b = philox(s.seed, group + 1, s.offset);
  keep[0] = a.x < threshold; keep[1] = a.y < threshold;
  keep[2] = a.z < threshold; keep[3] = a.w < threshold;
  keep[4] = b.x < threshold; keep[5] = b.y < threshold;
  keep[6] = b.z < threshold; keep[7] = b.w < threshold;
}

// Sum of v over the tpr threads (a power of two) that share a row: threadIdx.x in [0, tpr),
// threadIdx.y the row slot, blockDim.x == tpr. Rows narrower than a warp are aligned lane groups
// (a butterfly gives every lane the same bits); wider rows add their warps' partials through
// `smem` (N floats per warp of the block). Every thread of the block must call it.
template <int N>
__device__ inline void row_allreduce(float (&v)[N], int tpr, float* smem) {
  const int width = tpr < 32 ? tpr : 32;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    for (int off = width / 2; off > 0; off >>= 1) {
      v[n] += __shfl_xor_sync(0xffffffffu, v[n], off);
    }
  }
  if (tpr > 32) {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int warps_per_row = tpr / 32;
    if (lane == 0) {
#pragma unroll
      for (int n = 0; n < N; ++n) smem[warp * N + n] = v[n];
    }
    __syncthreads();
    const int first = (warp / warps_per_row) * warps_per_row;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      float s = 0.f;
      for (int w = 0; w < warps_per_row; ++w) s += smem[(first + w) * N + n];
      v[n] = s;
    }
    __syncthreads();  // smem is reused by the next reduction
  }
}

inline int next_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace layer_norm
