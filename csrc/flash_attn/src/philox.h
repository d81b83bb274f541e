// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): a counter-based
// generator, so any element's random number is computed from its position alone and the
// backward replays the forward's dropout mask exactly.
#pragma once

#include <cstdint>

#include "flash.h"

namespace flash {

__host__ __device__ __forceinline__ uint32_t mul_hi(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return uint32_t((uint64_t(a) * b) >> 32);  // host: tests check the generator on the CPU
#endif
}

// Counter words (x, y, z, w) = (counter_lo low, counter_lo high, counter_hi low, counter_hi
// high); key words = (seed low, seed high).
__host__ __device__ __forceinline__ uint4 philox4x32_10(uint64_t seed, uint64_t counter_hi, uint64_t counter_lo) {
    constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
    constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
    uint32_t key0 = uint32_t(seed), key1 = uint32_t(seed >> 32);
    uint4 c = make_uint4(uint32_t(counter_lo), uint32_t(counter_lo >> 32),
                         uint32_t(counter_hi), uint32_t(counter_hi >> 32));
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const uint32_t hi0 = mul_hi(kMul0, c.x), lo0 = kMul0 * c.x;
        const uint32_t hi1 = mul_hi(kMul1, c.z), lo1 = kMul1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ key0, lo1, hi0 ^ c.w ^ key1, lo0);
        key0 += kWeyl0;
        key1 += kWeyl1;
    }
    return c;
}

// The seed and offset of this launch (read from device memory under CUDA-graph capture).
__device__ __forceinline__ void philox_seed_offset(const PhiloxState &state, uint64_t &seed, uint64_t &offset) {
    if (state.captured) {
        seed = uint64_t(*state.seed_ptr);
        offset = uint64_t(*state.offset_ptr) + state.offset_intragraph;
    } else {
        seed = state.seed;
        offset = state.offset;
    }
}

}  // namespace flash
