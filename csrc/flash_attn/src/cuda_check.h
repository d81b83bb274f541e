// Turns a failed CUDA runtime call into an exception that names the call.
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

}  // namespace flash
