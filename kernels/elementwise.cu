// Row-wise and element-wise steps of the forward pass, f32 throughout.
// Each matches the CPU backend's formula (src/backend/cpu/elementwise.rs);
// sums run in a different order, so results agree to rounding.
#include <stdint.h>

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) part[wid] = v;
    __syncthreads();
    const int nw = blockDim.x >> 5;
    v = lane < nw ? part[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// out[i] = x[first + i] / rms(x[first + i]) · w, rows of `dim`; one block a row.
extern "C" __global__ void rmsnorm(const float *__restrict__ x, const float *__restrict__ w,
                                   float *__restrict__ out, int dim, float eps) {
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *o = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * r * w[i];
}

// In place, rows of `dim` (the per-head norms).
extern "C" __global__ void rmsnorm_inplace(float *__restrict__ x, const float *__restrict__ w,
                                           int dim, float eps) {
    float *xr = x + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xr[i] = xr[i] * r * w[i];
}

// x += b, then b = rmsnorm(x) · w, rows of `dim`.
extern "C" __global__ void add_rmsnorm(float *__restrict__ x, float *__restrict__ b,
                                       const float *__restrict__ w, int dim, float eps) {
    float *xr = x + (size_t)blockIdx.x * dim;
    float *br = b + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] + br[i];
        xr[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) br[i] = xr[i] * r * w[i];
}

// x[i] += b[i % width] for i < len.
extern "C" __global__ void add_bias(float *__restrict__ x, const float *__restrict__ b, int width,
                                    long long len) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += b[i % width];
}

// x[i] += y[i] for i < len.
extern "C" __global__ void add_vec(float *__restrict__ x, const float *__restrict__ y,
                                   long long len) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// x[i] *= s for i < len.
extern "C" __global__ void scale_vec(float *__restrict__ x, float s, long long len) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x)
        x[i] *= s;
}

// gate = silu(gate) · up.
extern "C" __global__ void swiglu(float *__restrict__ g, const float *__restrict__ u,
                                  long long len) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        float v = g[i];
        g[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

// gate = gelu_tanh(gate) · up.
extern "C" __global__ void geglu(float *__restrict__ g, const float *__restrict__ u,
                                 long long len) {
    const float c = 0.7978845608028654f; // √(2/π)
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        float v = g[i];
        g[i] = 0.5f * v * (1.0f + tanhf(c * v * (1.0f + 0.044715f * v * v))) * u[i];
    }
}

// RoPE of `n_tok` rows of `n_heads` heads of `head_dim` at positions pos0..:
// pair i of a head rotates by θ_i = pos · theta_scale^i (÷ freq factor,
// × pos_scale), pairs (2i, 2i+1) (normal) or (i, i + n_rot/2) (neox); the
// angle sequence is built by repeated multiplication as the CPU does.
extern "C" __global__ void rope(float *__restrict__ x, int n_tok, int n_heads, int head_dim,
                                int pos0, int n_rot, float theta_scale,
                                const float *__restrict__ freq_factors, float pos_scale,
                                float mscale, int neox) {
    const int half = n_rot / 2;
    const long long total = (long long)n_tok * n_heads * half;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const long long th = idx / half; // token · n_heads + head
        const int t = (int)(th / n_heads);
        float theta = (float)(pos0 + t);
        for (int k = 0; k < i; ++k) theta *= theta_scale;
        float a = (freq_factors ? theta / freq_factors[i] : theta) * pos_scale;
        float c = cosf(a) * mscale, s = sinf(a) * mscale;
        float *hx = x + th * head_dim;
        const int p0 = neox ? i : 2 * i, p1 = neox ? i + half : 2 * i + 1;
        float x0 = hx[p0], x1 = hx[p1];
        hx[p0] = x0 * c - x1 * s;
        hx[p1] = x0 * s + x1 * c;
    }
}

// dst row i = src row rows[i], rows of `width`; one block a row.
extern "C" __global__ void gather_rows(const float *__restrict__ src,
                                       const unsigned int *__restrict__ rows,
                                       float *__restrict__ dst, int width) {
    const float *s = src + (size_t)rows[blockIdx.x] * width;
    float *d = dst + (size_t)blockIdx.x * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) d[j] = s[j];
}

// dst row rows[i] = src row i · weights[i]; one block a row.
extern "C" __global__ void scatter_rows(float *__restrict__ dst, const float *__restrict__ src,
                                        const unsigned int *__restrict__ rows,
                                        const float *__restrict__ weights, int width) {
    const float *s = src + (size_t)blockIdx.x * width;
    float *d = dst + (size_t)rows[blockIdx.x] * width;
    const float wt = weights[blockIdx.x];
    for (int j = threadIdx.x; j < width; j += blockDim.x) d[j] = s[j] * wt;
}

// dst row t = Σ_{j<k} src row t·k + j, in order of j; one block a row.
extern "C" __global__ void sum_groups(const float *__restrict__ src, float *__restrict__ dst,
                                      int k, int width) {
    const int t = blockIdx.x;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float a = 0.0f;
        for (int j = 0; j < k; ++j) a += src[((size_t)t * k + j) * width + c];
        dst[(size_t)t * width + c] = a;
    }
}

// Σ of n4 float4 values per block into out[blockIdx.x]: a streaming read
// for measuring the device's read bandwidth (`kvrun bench`'s roofline).
extern "C" __global__ void read_sum(const float4 *__restrict__ x, long long n4,
                                    float *__restrict__ out) {
    float a = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        float4 v = x[i];
        a += v.x + v.y + v.z + v.w;
    }
    a = block_sum(a);
    if (threadIdx.x == 0) out[blockIdx.x] = a;
}
