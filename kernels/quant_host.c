/* kernels/quant.cuh built for the host: the tests compare its decoding of
   every weight format with the CPU dequantizers (src/backend/cuda/plan.rs). */
#include "quant.cuh"

void kvrun_host_deq32(int type, const uint8_t *row, int s, float *out) {
    kv_deq32(type, row, s, out);
}

int kvrun_host_block_bytes(int type) { return kv_block_bytes(type); }
