// The launchers' CUDA runtime helpers: a failed call turned into an exception that names it, the
// current device's architecture, and the warp-specialised kernels' flags.
#pragma once

#include <cstdlib>
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

// A warp-specialised kernel's flag (the launchers read it once per process): kWsAuto when unset or
// empty (the launcher's own rule decides), 0 off Hopper and for anything but one digit 1..max_mode.
constexpr int kWsAuto = -1;
inline int sm90_ws_flag(const char *name, int max_mode) {
    if (!current_device_is_sm90()) { return 0; }
    const char *flag = std::getenv(name);
    if (flag == nullptr || flag[0] == '\0') { return kWsAuto; }
    return flag[0] >= '1' && flag[0] <= '0' + max_mode && flag[1] == '\0' ? flag[0] - '0' : 0;
}

}  // namespace flash
