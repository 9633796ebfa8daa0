//! Rotary position embeddings: the rotation's parameters (style, rotated
//! dimensions, base, optional per-pair factors, linear scale) and its
//! reference application. Backend-neutral: the model describes the rotation
//! with it, every backend applies the same angles.

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x0,x1),(x2,x3),... (GGUF llama: Q/K rows pre-permuted).
    Normal,
    /// Halves (x_i, x_{i+d/2}) (Qwen2 GGUF, and HF safetensors llama).
    Neox,
}

/// Precomputed RoPE parameters.
#[derive(Clone, Debug)]
pub struct Rope {
    pub style: RopeStyle,
    /// Rotated dimensions per head (≤ head_dim).
    pub n_rot: usize,
    /// base^(-2/n_rot): ratio between the angles of consecutive pairs.
    pub theta_scale: f32,
    /// Optional per-pair frequency divisors (`rope_freqs.weight`, Llama 3.1).
    pub freq_factors: Option<Vec<f32>>,
    /// Linear position scale (1 / rope scaling factor).
    pub pos_scale: f32,
    /// cos and sin are multiplied by this (LongRoPE's attention factor;
    /// 1 otherwise).
    pub mscale: f32,
}

impl Rope {
    /// Build from base frequency, rotated dims, optional per-dim factors
    /// (`rope_freqs.weight`, Llama-3.1 style) and a linear scale.
    pub fn new(
        style: RopeStyle,
        n_rot: usize,
        base: f32,
        freq_factors: Option<&[f32]>,
        pos_scale: f32,
    ) -> Rope {
        assert!(n_rot <= 256, "at most 256 rotated dims");
        Rope {
            style,
            n_rot,
            theta_scale: base.powf(-2.0 / n_rot as f32),
            freq_factors: freq_factors.map(|f| f.to_vec()),
            pos_scale,
            mscale: 1.0,
        }
    }

    /// Rotate `n_heads` heads of `head_dim` in `x` (n_heads*head_dim) at `pos`.
    ///
    /// The angle of pair i is built as ggml builds it (theta_0 = pos, then
    /// repeated multiplication by base^(-2/n_rot)) rather than with powf per
    /// pair: the two differ in the last bits, and this model family turns
    /// last-bit differences into visible logit differences.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, head_dim: usize, pos: usize) {
        self.apply_at(x, n_heads, head_dim, pos as f32)
    }

    /// `apply` at any real position, negative included (R(-p) undoes R(p);
    /// rotations compose: R(a)R(b) = R(a+b)).
    pub fn apply_at(&self, x: &mut [f32], n_heads: usize, head_dim: usize, pos: f32) {
        let half = self.n_rot / 2;
        let mut cs = [(0f32, 0f32); 128];
        let mut theta = pos;
        for i in 0..half {
            let t = match &self.freq_factors {
                Some(ff) => theta / ff[i],
                None => theta,
            } * self.pos_scale;
            cs[i] = (t.cos() * self.mscale, t.sin() * self.mscale);
            theta *= self.theta_scale;
        }
        for h in 0..n_heads {
            let hx = &mut x[h * head_dim..(h + 1) * head_dim];
            for i in 0..half {
                let (c, s) = cs[i];
                let (a, b) = match self.style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (hx[a], hx[b]);
                hx[a] = x0 * c - x1 * s;
                hx[b] = x0 * s + x1 * c;
            }
        }
    }
}
