// Quantized matrix products: y (n_tok, n_out) = x (n_tok, n_in) · Wᵀ, with W
// n_out rows of raw GGUF blocks (row_bytes each) and x, y f32.
//
// - mmv_N (decoding, N ≤ 8 tokens): one warp per weight row; each lane
//   takes every 32nd sub-block of 32 values, dequantizes it once and uses it
//   for all N tokens; a warp reduction gives the N outputs. Bandwidth-bound:
//   every weight byte is read once per step.
// - mm_tile (prefill): a 64-row × 32-token output tile per block of 256
//   threads; 64-value slices of the 64 rows are dequantized into shared
//   memory, the tokens' slices loaded beside them, and each thread keeps a
//   4 × 2 register tile of sums.
#include "quant.cuh"

#define MMV_WARPS 4

template <int N>
__device__ __forceinline__ void mmv_body(int type, const uint8_t *__restrict__ w, size_t row_bytes,
                                         const float *__restrict__ x, float *__restrict__ y,
                                         int n_in, int n_out, int n_tok) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * MMV_WARPS + (threadIdx.x >> 5);
    if (r >= n_out) return;
    const uint8_t *row = w + (size_t)r * row_bytes;
    float acc[N];
#pragma unroll
    for (int t = 0; t < N; ++t) acc[t] = 0.0f;
    float v[32];
    const int n_sub = n_in >> 5;
    for (int s = lane; s < n_sub; s += 32) {
        kv_deq32(type, row, s, v);
#pragma unroll
        for (int t = 0; t < N; ++t) {
            if (t < n_tok) {
                const float4 *xs = (const float4 *)(x + (size_t)t * n_in + 32 * s);
                float a = 0.0f;
#pragma unroll
                for (int q = 0; q < 8; ++q) {
                    float4 xv = xs[q];
                    a += v[4 * q] * xv.x + v[4 * q + 1] * xv.y + v[4 * q + 2] * xv.z +
                         v[4 * q + 3] * xv.w;
                }
                acc[t] += a;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < N; ++t) {
        float a = acc[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (lane == 0 && t < n_tok) y[(size_t)t * n_out + r] = a;
    }
}

#define MMV(N)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * MMV_WARPS)                                 \
        mmv_##N(int type, const uint8_t *__restrict__ w, unsigned long long row_bytes,           \
                const float *__restrict__ x, float *__restrict__ y, int n_in, int n_out,         \
                int n_tok) {                                                                     \
        mmv_body<N>(type, w, (size_t)row_bytes, x, y, n_in, n_out, n_tok);                       \
    }
MMV(1)
MMV(2)
MMV(4)
MMV(8)

#define TM 64
#define TN 32
#define TK 64

extern "C" __global__ void __launch_bounds__(256)
    mm_tile(int type, const uint8_t *__restrict__ w, unsigned long long row_bytes,
            const float *__restrict__ x, float *__restrict__ y, int n_in, int n_out, int n_tok) {
    __shared__ float ws[TM][TK + 1];
    __shared__ float xs[TN][TK + 1];
    const int tid = threadIdx.x;
    const int r0 = blockIdx.x * TM, t0 = blockIdx.y * TN;
    // this thread's outputs: rows r0 + 4·ty .. + 4, tokens t0 + 2·tx .. + 2
    const int ty = tid >> 4, tx = tid & 15;
    float acc[4][2] = {{0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}};
    float v[32];
    for (int k0 = 0; k0 < n_in; k0 += TK) {
        // dequantize the 64 rows' slice k0 .. k0 + 64 (two sub-blocks each;
        // a slice past the row's end, when n_in is not a multiple of 64, is
        // zero)
        if (tid < 2 * TM) {
            int rr = tid >> 1, half = tid & 1, r = r0 + rr, s = (k0 >> 5) + half;
            if (r < n_out && 32 * s < n_in) {
                kv_deq32(type, w + (size_t)r * row_bytes, s, v);
            } else {
#pragma unroll
                for (int l = 0; l < 32; ++l) v[l] = 0.0f;
            }
#pragma unroll
            for (int l = 0; l < 32; ++l) ws[rr][32 * half + l] = v[l];
        }
        // the tokens' slices
        for (int i = tid; i < TN * TK; i += 256) {
            int tt = i / TK, kk = i % TK, t = t0 + tt, k = k0 + kk;
            xs[tt][kk] = (t < n_tok && k < n_in) ? x[(size_t)t * n_in + k] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < TK; ++kk) {
            float a0 = xs[2 * tx][kk], a1 = xs[2 * tx + 1][kk];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float wv = ws[4 * ty + i][kk];
                acc[i][0] += wv * a0;
                acc[i][1] += wv * a1;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int r = r0 + 4 * ty + i;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            int t = t0 + 2 * tx + j;
            if (r < n_out && t < n_tok) y[(size_t)t * n_out + r] = acc[i][j];
        }
    }
}

// x[t] = table row tokens[t] (dequantized), for t < n_tok: one block per token.
extern "C" __global__ void embed_rows(int type, const uint8_t *__restrict__ table,
                                      unsigned long long row_bytes,
                                      const unsigned int *__restrict__ tokens, float *__restrict__ x,
                                      int dim) {
    const int t = blockIdx.x;
    const uint8_t *row = table + (size_t)tokens[t] * (size_t)row_bytes;
    float v[32];
    for (int s = threadIdx.x; s < (dim >> 5); s += blockDim.x) {
        kv_deq32(type, row, s, v);
#pragma unroll
        for (int l = 0; l < 32; ++l) x[(size_t)t * dim + 32 * s + l] = v[l];
    }
}
