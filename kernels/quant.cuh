// Weight formats of GGUF files as the CUDA kernels read them: every type is
// read 32 values at a time (one "sub-block": a whole legacy block, or one
// 32-value slice of a 256-value K-quant superblock), in the order and with
// the float operations of the reference dequantizers, so a dequantized
// value is bit-identical to the CPU's.
//
// This header compiles as CUDA (device code) and as plain C++ (host code):
// the host build is linked into the Rust tests, which compare kv_deq32
// against the CPU dequantizers on random blocks, so the format decoding is
// tested on machines without a GPU.
#pragma once
#include <stdint.h>
#ifdef __CUDACC__
#define KV_HD __host__ __device__ __forceinline__
#else
#include <string.h>
#define KV_HD static inline
#endif

// Type codes, shared with src/backend/cuda/plan.rs (`TypeCode`).
enum {
    KV_F32 = 0,
    KV_F16 = 1,
    KV_BF16 = 2,
    KV_Q4_0 = 3,
    KV_Q4_1 = 4,
    KV_Q5_0 = 5,
    KV_Q5_1 = 6,
    KV_Q8_0 = 7,
    KV_Q4K = 8,
    KV_Q5K = 9,
    KV_Q6K = 10,
    KV_Q2K = 11,
    KV_Q3K = 12,
    KV_IQ4NL = 13,
    KV_IQ4XS = 14,
};

// f32 from its bits.
KV_HD float kv_bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

// IEEE half (bits) to f32, exact for every value (subnormals included).
KV_HD float kv_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0) {
        // zero or subnormal: m · 2^-24, exact in f32
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31) return kv_bits_f32(sign | 0x7f800000u | (m << 13));
    return kv_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// bfloat16 (bits) to f32.
KV_HD float kv_bf2f(uint16_t h) { return kv_bits_f32((uint32_t)h << 16); }

// Little-endian u16 at p (any alignment).
KV_HD uint16_t kv_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

// Bytes of one block and values per block of a type.
KV_HD int kv_block_bytes(int type) {
    switch (type) {
    case KV_F32: return 4;
    case KV_F16: return 2;
    case KV_BF16: return 2;
    case KV_Q4_0: return 18;
    case KV_Q4_1: return 20;
    case KV_Q5_0: return 22;
    case KV_Q5_1: return 24;
    case KV_Q8_0: return 34;
    case KV_Q4K: return 144;
    case KV_Q5K: return 176;
    case KV_Q6K: return 210;
    case KV_Q2K: return 84;
    case KV_Q3K: return 110;
    case KV_IQ4NL: return 18;
    case KV_IQ4XS: return 136;
    default: return 0;
    }
}
KV_HD int kv_block_values(int type) {
    switch (type) {
    case KV_F32: case KV_F16: case KV_BF16: return 1;
    case KV_Q2K: case KV_Q3K: case KV_Q4K: case KV_Q5K: case KV_Q6K: case KV_IQ4XS: return 256;
    default: return 32;
    }
}

// Scale and min of sub-block j (0..8) of a Q4_K / Q5_K superblock: 6-bit
// values packed in 12 bytes (the first four sub-blocks in the low 6 bits of
// bytes 0..8, the last four split over bytes 8..12 and the top bits).
KV_HD void kv_scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// The non-uniform grid of IQ4_NL / IQ4_XS: a 4-bit index picks a value.
KV_HD int kv_iq4(int i) {
    const int8_t grid[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                             1,    13,   25,  38,  53,  69,  89,  113};
    return grid[i & 15];
}

// Values 32·s .. 32·s + 32 of a row (raw GGUF blocks at `row`) as f32.
KV_HD void kv_deq32(int type, const uint8_t *row, int s, float *out) {
    switch (type) {
    case KV_F32: {
        const uint8_t *p = row + (size_t)s * 128;
        for (int l = 0; l < 32; ++l)
            out[l] = kv_bits_f32((uint32_t)p[4 * l] | ((uint32_t)p[4 * l + 1] << 8) |
                                 ((uint32_t)p[4 * l + 2] << 16) | ((uint32_t)p[4 * l + 3] << 24));
        break;
    }
    case KV_F16: {
        const uint8_t *p = row + (size_t)s * 64;
        for (int l = 0; l < 32; ++l) out[l] = kv_h2f(kv_u16(p + 2 * l));
        break;
    }
    case KV_BF16: {
        const uint8_t *p = row + (size_t)s * 64;
        for (int l = 0; l < 32; ++l) out[l] = kv_bf2f(kv_u16(p + 2 * l));
        break;
    }
    case KV_Q4_0: {
        // d, then 16 bytes: value l in the low nibble of byte l, value
        // l + 16 in its high nibble; x = d · (q − 8)
        const uint8_t *b = row + (size_t)s * 18;
        float d = kv_h2f(kv_u16(b));
        for (int l = 0; l < 16; ++l) {
            out[l] = (float)((b[2 + l] & 0xF) - 8) * d;
            out[l + 16] = (float)((b[2 + l] >> 4) - 8) * d;
        }
        break;
    }
    case KV_Q4_1: {
        // d, m, 16 bytes of nibbles; x = d · q + m
        const uint8_t *b = row + (size_t)s * 20;
        float d = kv_h2f(kv_u16(b)), m = kv_h2f(kv_u16(b + 2));
        for (int l = 0; l < 16; ++l) {
            out[l] = (float)(b[4 + l] & 0xF) * d + m;
            out[l + 16] = (float)(b[4 + l] >> 4) * d + m;
        }
        break;
    }
    case KV_Q5_0: {
        // d, 32 high bits (bit l = 5th bit of value l), 16 bytes of nibbles;
        // x = d · (q − 16)
        const uint8_t *b = row + (size_t)s * 22;
        float d = kv_h2f(kv_u16(b));
        uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) |
                      ((uint32_t)b[5] << 24);
        for (int l = 0; l < 16; ++l) {
            int h0 = ((qh >> l) << 4) & 0x10, h1 = (qh >> (l + 12)) & 0x10;
            out[l] = (float)(((b[6 + l] & 0xF) | h0) - 16) * d;
            out[l + 16] = (float)(((b[6 + l] >> 4) | h1) - 16) * d;
        }
        break;
    }
    case KV_Q5_1: {
        const uint8_t *b = row + (size_t)s * 24;
        float d = kv_h2f(kv_u16(b)), m = kv_h2f(kv_u16(b + 2));
        uint32_t qh = (uint32_t)b[4] | ((uint32_t)b[5] << 8) | ((uint32_t)b[6] << 16) |
                      ((uint32_t)b[7] << 24);
        for (int l = 0; l < 16; ++l) {
            int h0 = ((qh >> l) << 4) & 0x10, h1 = (qh >> (l + 12)) & 0x10;
            out[l] = (float)((b[8 + l] & 0xF) | h0) * d + m;
            out[l + 16] = (float)((b[8 + l] >> 4) | h1) * d + m;
        }
        break;
    }
    case KV_Q8_0: {
        const uint8_t *b = row + (size_t)s * 34;
        float d = kv_h2f(kv_u16(b));
        for (int l = 0; l < 32; ++l) out[l] = (float)(int8_t)b[2 + l] * d;
        break;
    }
    case KV_Q4K: {
        // superblock: d, dmin, 12 scale bytes, 128 bytes of nibbles; sub-block
        // j reads the low (even j) or high (odd j) nibbles of bytes
        // 32·(j/2) .. + 32; x = (d·sc) · q − dmin·m
        const uint8_t *b = row + (size_t)(s >> 3) * 144;
        int j = s & 7, sc, mn;
        float d = kv_h2f(kv_u16(b)), dmin = kv_h2f(kv_u16(b + 2));
        kv_scale_min_k4(j, b + 4, &sc, &mn);
        float d1 = d * (float)sc, m1 = dmin * (float)mn;
        const uint8_t *q = b + 16 + 32 * (j >> 1);
        int sh = (j & 1) * 4;
        for (int l = 0; l < 32; ++l) out[l] = d1 * (float)((q[l] >> sh) & 0xF) - m1;
        break;
    }
    case KV_Q5K: {
        // as Q4_K, plus 32 bytes of high bits: bit j of byte l is the 5th
        // bit of value l of sub-block j
        const uint8_t *b = row + (size_t)(s >> 3) * 176;
        int j = s & 7, sc, mn;
        float d = kv_h2f(kv_u16(b)), dmin = kv_h2f(kv_u16(b + 2));
        kv_scale_min_k4(j, b + 4, &sc, &mn);
        float d1 = d * (float)sc, m1 = dmin * (float)mn;
        const uint8_t *qh = b + 16, *q = b + 48 + 32 * (j >> 1);
        int sh = (j & 1) * 4;
        for (int l = 0; l < 32; ++l)
            out[l] = d1 * (float)(((q[l] >> sh) & 0xF) + (((qh[l] >> j) & 1) << 4)) - m1;
        break;
    }
    case KV_Q6K: {
        // superblock: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16
        // signed scales (one per 16 values), d. Each half of 128 values:
        // quarter r of it takes the low (r = 0, 1) or high (r = 2, 3)
        // nibbles of bytes (r & 1)·32 .. + 32 and bits 2r, 2r+1 of the highs;
        // x = (d · scale) · (q − 32)
        const uint8_t *b = row + (size_t)(s >> 3) * 210;
        int j = s & 7, n = j >> 2, r = j & 3;
        float d = kv_h2f(kv_u16(b + 208));
        const uint8_t *ql = b + 64 * n + 32 * (r & 1), *qh = b + 128 + 32 * n;
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * n);
        int lsh = (r >> 1) * 4, hsh = 2 * r;
        for (int l = 0; l < 32; ++l) {
            int q = (int)(int8_t)(((ql[l] >> lsh) & 0xF) | (((qh[l] >> hsh) & 3) << 4)) - 32;
            out[l] = d * (float)sc[(l >> 4) + 2 * r] * (float)q;
        }
        break;
    }
    case KV_Q2K: {
        // superblock: 16 scale bytes (scale low nibble, min high nibble, one
        // per 16 values), 64 bytes of 2-bit quants, d, dmin. Sub-block j
        // takes bits 2·(j & 3) of bytes 32·(j >> 2) .. + 32;
        // x = (d·sc) · q − dmin·m
        const uint8_t *b = row + (size_t)(s >> 3) * 84;
        int j = s & 7;
        float d = kv_h2f(kv_u16(b + 80)), dmin = kv_h2f(kv_u16(b + 82));
        const uint8_t *q = b + 16 + 32 * (j >> 2);
        int sh = 2 * (j & 3);
        for (int l = 0; l < 32; ++l) {
            int sc = b[2 * j + (l >> 4)];
            float d1 = d * (float)(sc & 0xF), m1 = dmin * (float)(sc >> 4);
            out[l] = d1 * (float)((q[l] >> sh) & 3) - m1;
        }
        break;
    }
    case KV_Q3K: {
        // superblock: 32 bytes of high bits (bit j of byte l: value l of
        // sub-block j has its 3rd bit), 64 bytes of low 2 bits (as Q2_K),
        // 12 bytes of 16 packed 6-bit scales, d; q = low − (high ? 0 : 4),
        // x = (d · (sc − 32)) · q
        const uint8_t *b = row + (size_t)(s >> 3) * 110;
        int j = s & 7;
        float d = kv_h2f(kv_u16(b + 108));
        const uint8_t *hm = b, *q = b + 32 + 32 * (j >> 2), *sb = b + 96;
        int sh = 2 * (j & 3);
        for (int l = 0; l < 32; ++l) {
            int k = 2 * j + (l >> 4);  // scale 0..16
            int k8 = k & 7, top = (sb[8 + (k8 & 3)] >> (2 * (k8 >> 2) + 4 * (k >> 3))) & 3;
            int sc = (k < 8 ? (sb[k8] & 0xF) : (sb[k8] >> 4)) | (top << 4);
            int v = ((q[l] >> sh) & 3) - (((hm[l] >> j) & 1) ? 0 : 4);
            out[l] = (d * (float)(sc - 32)) * (float)v;
        }
        break;
    }
    case KV_IQ4NL: {
        // d, 16 bytes of grid indices (value l: low nibble of byte l, value
        // l + 16: its high nibble); x = d · grid[i]
        const uint8_t *b = row + (size_t)s * 18;
        float d = kv_h2f(kv_u16(b));
        for (int l = 0; l < 16; ++l) {
            out[l] = d * (float)kv_iq4(b[2 + l] & 0xF);
            out[l + 16] = d * (float)kv_iq4(b[2 + l] >> 4);
        }
        break;
    }
    case KV_IQ4XS: {
        // superblock: d, 16 bits of scale tops (2 per sub-block), 4 bytes of
        // scale nibbles, then 16 bytes of grid indices per sub-block as
        // IQ4_NL; x = (d · (ls − 32)) · grid[i]
        const uint8_t *b = row + (size_t)(s >> 3) * 136;
        int j = s & 7;
        float d = kv_h2f(kv_u16(b));
        int ls = ((b[4 + (j >> 1)] >> (4 * (j & 1))) & 0xF) | (((kv_u16(b + 2) >> (2 * j)) & 3) << 4);
        float dl = d * (float)(ls - 32);
        const uint8_t *q = b + 8 + 16 * j;
        for (int l = 0; l < 16; ++l) {
            out[l] = dl * (float)kv_iq4(q[l] & 0xF);
            out[l + 16] = dl * (float)kv_iq4(q[l] >> 4);
        }
        break;
    }
    default:
        for (int l = 0; l < 32; ++l) out[l] = 0.0f;
    }
}
