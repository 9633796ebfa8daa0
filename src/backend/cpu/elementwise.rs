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
