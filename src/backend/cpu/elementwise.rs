//! Row-wise and elementwise steps: RMSNorm, SwiGLU, residual add. Plain
//! Rust written to auto-vectorize; each is its own scalar reference.

/// out = x / rms(x) * w, for each of the rows of x (row length w.len()).
pub fn rmsnorm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (o, xr) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        // Sum of squares in f64, as ggml does, so long rows lose nothing.
        let ss = (xr.iter().map(|&v| (v * v) as f64).sum::<f64>() / d as f64) as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, &xv), &wv) in o.iter_mut().zip(xr).zip(w) {
            *o = xv * scale * wv;
        }
    }
}

/// gate = silu(gate) * up, elementwise.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = x / (1.0 + (-x).exp()) * u;
    }
}

/// x += y, elementwise.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// x = x / rms(x) * w in place, for each of the rows of x (row length
/// w.len()): the per-head query/key norm.
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let ss = (xr.iter().map(|&v| (v * v) as f64).sum::<f64>() / d as f64) as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for (xv, &wv) in xr.iter_mut().zip(w) {
            *xv = *xv * scale * wv;
        }
    }
}

/// GELU with the tanh approximation, in f32.
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

/// GELU of every f16 value, rounded to f16 (bit pattern → bit pattern):
/// ggml evaluates GELU through such a table, so kvrun does too and rounds
/// exactly as llama.cpp does.
fn gelu_table() -> &'static [u16] {
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|h| crate::quant::f32_to_f16(gelu_tanh(crate::quant::f16_to_f32(h))))
            .collect()
    })
}

/// gate = gelu(gate) * up, elementwise (GeGLU), with GELU looked up on
/// the f16-rounded input as ggml does (identity above 10, 0 below −10).
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    let t = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            crate::quant::f16_to_f32(t[crate::quant::f32_to_f16(x) as usize]) * u
        };
    }
}

/// x *= s, elementwise.
pub fn scale(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}
