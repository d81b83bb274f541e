// The consumer warpgroups' turns at the tensor cores (ping-pong), round robin: consumer c waits on
// named barrier 1 + c, 256 threads: its own 128 and the 128 arrivals of the consumer before it.
// The ids are in registers: chosen by a branch between two barriers, they cost the main loop its
// uniform wgmma descriptors (d64 forward, two consumers: 19 R2UR a turn, then none; 2-4% on the
// H200). Used by the warp-specialised forward and backward; barriers 1 .. kConsumers are theirs.
#pragma once

#include "utils.h"

namespace flash {

template <int kConsumers>
__device__ __forceinline__ void ws_wait_turn(int consumer) {
    named_barrier_sync<256>(1 + consumer);
}
template <int kConsumers>
__device__ __forceinline__ void ws_pass_turn(int consumer) {
    named_barrier_arrive<256>(consumer == kConsumers - 1 ? 1 : 2 + consumer);
}

}  // namespace flash
