// Attention over the live K/V rows of a layer, flash-decoding style, and
// the K/V row stores.
//
// The cache's metadata stays on the host; each step the host uploads, per
// KV head of a layer, a head record {first entry, entry count, unit base
// (lo, hi), unit stride} and the entries themselves (slot, position)
// (src/backend/cuda/plan.rs builds both). Entry e of head g lives at storage
// unit base + slot · stride (a unit is one value for f32/f16 stores, one
// 34-byte q8_0 block of 32 values for q8_0 stores).
//
// - attn_part: grid (splits, tokens, KV heads). A block takes the `chunk`
//   entries of its split, scores them against the query heads of its KV
//   head (causal by position, optional sliding window), and writes
//   unnormalized outputs with their softmax statistics (max, sum).
// - attn_combine: grid (heads, tokens): merges the splits exactly and keeps
//   each row's final (max, sum) for the mass export.
// - attn_mass: grid (splits, rows, KV heads): recomputes the probabilities
//   of the exported query rows and adds weight · Σ_heads p into mass[slot].
#include <cuda_fp16.h>
#include "quant.cuh"

#define KV_MAX_GROUP 16
#define KV_MAX_HD 256
#define ATT_THREADS 128
#define ATT_CHUNK 128

struct HeadRec {
    unsigned int first, count, base_lo, base_hi, stride;
};

// Value d of the row at storage unit `u` of a store of `type` (KV_F32,
// KV_F16 or KV_Q8_0).
__device__ __forceinline__ float kv_at(int type, const uint8_t *store, unsigned long long u,
                                       int d) {
    if (type == KV_F16) return __half2float(((const __half *)store)[u + d]);
    if (type == KV_F32) return ((const float *)store)[u + d];
    const uint8_t *b = store + (u + (d >> 5)) * 34;
    return (float)(int8_t)b[2 + (d & 31)] * __half2float(*(const __half *)b);
}

__device__ __forceinline__ const HeadRec *head_rec(const unsigned int *heads, int g) {
    return (const HeadRec *)(heads + 5 * g);
}

__device__ __forceinline__ bool visible(int pos, int qpos, int window) {
    return pos <= qpos && (window == 0 || pos > qpos - window);
}

// Scores of this block's chunk of entries for every query head of the
// group, into sc[g][j] (−inf where a key is not visible). Warp w takes
// entries w, w + 4, ...; lanes split the head dimension.
__device__ void chunk_scores(const float *__restrict__ qg, int group, int hd, int type,
                             const uint8_t *__restrict__ kst, const HeadRec *h,
                             const unsigned int *__restrict__ ent, int e0, int ne, int qpos,
                             int window, float scale, float (*sc)[ATT_CHUNK]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned long long base = ((unsigned long long)h->base_hi << 32) | h->base_lo;
    for (int j = warp; j < ATT_CHUNK; j += ATT_THREADS / 32) {
        bool ok = j < ne;
        unsigned int slot = 0;
        int pos = 0;
        if (ok) {
            slot = ent[2 * (h->first + e0 + j)];
            pos = (int)ent[2 * (h->first + e0 + j) + 1];
            ok = visible(pos, qpos, window);
        }
        if (!ok) {
            if (lane < group) sc[lane][j] = -INFINITY;
            continue;
        }
        const unsigned long long u = base + (unsigned long long)slot * h->stride;
        float kv[KV_MAX_HD / 32];
        for (int m = 0; m < hd / 32; ++m) kv[m] = kv_at(type, kst, u, lane + 32 * m);
        for (int g = 0; g < group; ++g) {
            float a = 0.0f;
            for (int m = 0; m < hd / 32; ++m) a += qg[g * hd + lane + 32 * m] * kv[m];
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0) sc[g][j] = a * scale;
        }
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attn_part(const float *__restrict__ q, int n_heads, int hd, int group, int type,
              const uint8_t *__restrict__ kst, const uint8_t *__restrict__ vst,
              const unsigned int *__restrict__ heads, const unsigned int *__restrict__ ent,
              int pos0, int window, float scale, int n_split, float *__restrict__ part_out,
              float *__restrict__ part_ml) {
    __shared__ float qs[KV_MAX_GROUP * KV_MAX_HD];
    __shared__ float sc[KV_MAX_GROUP][ATT_CHUNK];
    __shared__ float stat[KV_MAX_GROUP][2];
    const int split = blockIdx.x, t = blockIdx.y, kvh = blockIdx.z;
    const HeadRec *h = head_rec(heads, kvh);
    const int e0 = split * ATT_CHUNK;
    const int ne = max(0, min(ATT_CHUNK, (int)h->count - e0));
    const int qpos = pos0 + t;
    // this block's query heads                                 (group, hd)
    const float *qt = q + ((size_t)t * n_heads + (size_t)kvh * group) * hd;
    for (int i = threadIdx.x; i < group * hd; i += ATT_THREADS) qs[i] = qt[i];
    __syncthreads();
    // scores                                                   (group, chunk)
    chunk_scores(qs, group, hd, type, kst, h, ent, e0, ne, qpos, window, scale, sc);
    __syncthreads();
    // per head: max, then p = exp(s − max) in place, and the sum
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g = warp; g < group; g += ATT_THREADS / 32) {
        float m = -INFINITY;
        for (int j = lane; j < ATT_CHUNK; j += 32) m = fmaxf(m, sc[g][j]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.0f;
        for (int j = lane; j < ATT_CHUNK; j += 32) {
            float p = m == -INFINITY ? 0.0f : __expf(sc[g][j] - m);
            sc[g][j] = p;
            l += p;
        }
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) {
            stat[g][0] = m;
            stat[g][1] = l;
        }
    }
    __syncthreads();
    // unnormalized outputs Σ_j p_j · v_j                        (group, hd)
    const unsigned long long base = ((unsigned long long)h->base_hi << 32) | h->base_lo;
    for (int i = threadIdx.x; i < group * hd; i += ATT_THREADS) {
        const int g = i / hd, d = i % hd;
        float acc = 0.0f;
        if (stat[g][1] > 0.0f) {
            for (int j = 0; j < ne; ++j) {
                const float p = sc[g][j];
                if (p == 0.0f) continue;
                const unsigned int slot = ent[2 * (h->first + e0 + j)];
                acc += p * kv_at(type, vst, base + (unsigned long long)slot * h->stride, d);
            }
        }
        const size_t row = ((size_t)t * n_heads + (size_t)kvh * group + g) * n_split + split;
        part_out[row * hd + d] = acc;
        if (d == 0) {
            part_ml[2 * row] = stat[g][0];
            part_ml[2 * row + 1] = stat[g][1];
        }
    }
}

extern "C" __global__ void attn_combine(const float *__restrict__ part_out,
                                        const float *__restrict__ part_ml, int n_heads, int hd,
                                        int n_split, float *__restrict__ out,
                                        float *__restrict__ row_ml) {
    const int hh = blockIdx.x, t = blockIdx.y;
    const size_t r0 = ((size_t)t * n_heads + hh) * n_split;
    float m = -INFINITY;
    for (int s = 0; s < n_split; ++s)
        if (part_ml[2 * (r0 + s) + 1] > 0.0f) m = fmaxf(m, part_ml[2 * (r0 + s)]);
    float l = 0.0f;
    for (int s = 0; s < n_split; ++s) {
        const float ls = part_ml[2 * (r0 + s) + 1];
        if (ls > 0.0f) l += ls * __expf(part_ml[2 * (r0 + s)] - m);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_split; ++s) {
            const float ls = part_ml[2 * (r0 + s) + 1];
            if (ls > 0.0f) a += part_out[(r0 + s) * hd + d] * __expf(part_ml[2 * (r0 + s)] - m);
        }
        out[((size_t)t * n_heads + hh) * hd + d] = l > 0.0f ? a / l : 0.0f;
    }
    if (threadIdx.x == 0) {
        row_ml[2 * ((size_t)t * n_heads + hh)] = m;
        row_ml[2 * ((size_t)t * n_heads + hh) + 1] = l;
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attn_mass(const float *__restrict__ q, int n_heads, int hd, int group, int type,
              const uint8_t *__restrict__ kst, const unsigned int *__restrict__ heads,
              const unsigned int *__restrict__ ent, int pos0, int window, float scale,
              int first_row, const float *__restrict__ row_ml, float weight,
              float *__restrict__ mass) {
    __shared__ float qs[KV_MAX_GROUP * KV_MAX_HD];
    __shared__ float sc[KV_MAX_GROUP][ATT_CHUNK];
    const int split = blockIdx.x, t = first_row + blockIdx.y, kvh = blockIdx.z;
    const HeadRec *h = head_rec(heads, kvh);
    const int e0 = split * ATT_CHUNK;
    const int ne = max(0, min(ATT_CHUNK, (int)h->count - e0));
    if (ne == 0) return;
    const float *qt = q + ((size_t)t * n_heads + (size_t)kvh * group) * hd;
    for (int i = threadIdx.x; i < group * hd; i += ATT_THREADS) qs[i] = qt[i];
    __syncthreads();
    chunk_scores(qs, group, hd, type, kst, h, ent, e0, ne, pos0 + t, window, scale, sc);
    __syncthreads();
    for (int j = threadIdx.x; j < ne; j += ATT_THREADS) {
        float p = 0.0f;
        for (int g = 0; g < group; ++g) {
            const size_t r = (size_t)t * n_heads + (size_t)kvh * group + g;
            const float m = row_ml[2 * r], l = row_ml[2 * r + 1];
            if (l > 0.0f && sc[g][j] != -INFINITY) p += __expf(sc[g][j] - m) / l;
        }
        if (p != 0.0f) atomicAdd(&mass[ent[2 * (h->first + e0 + j)]], weight * p);
    }
}

// Store the step's K and V rows: for token t and KV head g, values
// g·hd .. + hd of rows t of k and v (n_tok, kv_dim) go to storage unit
// dest[t·n_kv + g] of the K and V stores. One block per (t, g).
extern "C" __global__ void kv_store_rows(const float *__restrict__ k, const float *__restrict__ v,
                                         int kv_dim, int n_kv, int hd,
                                         const unsigned long long *__restrict__ dest, int type,
                                         uint8_t *__restrict__ kst, uint8_t *__restrict__ vst) {
    const int t = blockIdx.x / n_kv, g = blockIdx.x % n_kv;
    const unsigned long long u = dest[blockIdx.x];
    for (int which = 0; which < 2; ++which) {
        const float *src = (which ? v : k) + (size_t)t * kv_dim + (size_t)g * hd;
        uint8_t *st = which ? vst : kst;
        if (type == KV_F32) {
            for (int d = threadIdx.x; d < hd; d += blockDim.x) ((float *)st)[u + d] = src[d];
        } else if (type == KV_F16) {
            for (int d = threadIdx.x; d < hd; d += blockDim.x)
                ((__half *)st)[u + d] = __float2half_rn(src[d]);
        } else {
            // q8_0, as quantize_row_q8_0: d = max|x| / 127, q = round(x / d);
            // one warp per block of 32 values
            const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
            for (int b = warp; b < hd / 32; b += blockDim.x / 32) {
                const float x = src[32 * b + lane];
                float a = fabsf(x);
                for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
                const float d = a / 127.0f;
                const float id = d != 0.0f ? 1.0f / d : 0.0f;
                uint8_t *blk = st + (u + b) * 34;
                blk[2 + lane] = (uint8_t)(int8_t)roundf(x * id);
                if (lane == 0) *(__half *)blk = __float2half_rn(d);
            }
        }
    }
}

// out (n_rows, len) = values off .. off + len of the rows at storage units
// units[i] (a KvStore read; f32 out). One block per row.
extern "C" __global__ void kv_read_rows(const uint8_t *__restrict__ st, int type,
                                        const unsigned long long *__restrict__ units, int len,
                                        float *__restrict__ out) {
    const unsigned long long u = units[blockIdx.x];
    for (int d = threadIdx.x; d < len; d += blockDim.x)
        out[(size_t)blockIdx.x * len + d] = kv_at(type, st, u, d);
}

// Copy whole rows of `row_bytes` (moves[2i] → moves[2i + 1]) from one store
// to another (the store's resize). One block per move.
extern "C" __global__ void kv_move_rows(const uint8_t *__restrict__ src, uint8_t *__restrict__ dst,
                                        const unsigned int *__restrict__ moves,
                                        unsigned long long row_bytes) {
    const uint8_t *s = src + (size_t)moves[2 * blockIdx.x] * row_bytes;
    uint8_t *d = dst + (size_t)moves[2 * blockIdx.x + 1] * row_bytes;
    for (size_t i = threadIdx.x; i < row_bytes; i += blockDim.x) d[i] = s[i];
}
