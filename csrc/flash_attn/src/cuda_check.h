// The launchers' CUDA runtime helpers: a failed call turned into an exception that names it, and
// the current device's architecture.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

namespace flash {

inline void check_cuda(cudaError_t status, const char *what) {
    if (status != cudaSuccess) {
        throw std::runtime_error(std::string("flash_attn: ") + what + " failed: " + cudaGetErrorString(status));
    }
}

// Hopper (sm90): the warp-specialised kernels' flags take effect only there.
inline bool current_device_is_sm90() {
    int device = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    return major == 9;
}

}  // namespace flash
