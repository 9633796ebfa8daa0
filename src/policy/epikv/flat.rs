//! `epikv` (EpiKV-Flat, the default; the reference code's
//! `hs_variance_detrend`): detrended hidden-state change.
//!
//! Idea: g in band A drifts down and g in band B drifts up with position;
//! a causal rolling z-score per layer removes that trend. Score
//! s(t) = z_A(t) − z_B(t), with z_l(t) = (g_l(t) − μ)/(σ + 1e-6) over the
//! last W values of g_l including g_l(t) (population σ; z = 0 until two
//! values exist). Parameters: representative layers A = 10, B = 21 on a
//! 32-layer model (scaled by depth; `--epikv-layers`), W = 64
//! (`--epikv-window`).

use super::Rolling;

/// Rolling z-scores of the two representative layers.
#[derive(Debug, Clone)]
pub struct Flat {
    /// Tap indices of layers A and B.
    ta: usize,
    tb: usize,
    za: Rolling,
    zb: Rolling,
}

impl Flat {
    /// Layers at tap indices `ta`, `tb`, window `w`.
    pub fn new(ta: usize, tb: usize, w: usize) -> Flat {
        Flat {
            ta,
            tb,
            za: Rolling::new(w),
            zb: Rolling::new(w),
        }
    }
    /// Score of a token whose per-tap g values are `g`.
    pub fn push(&mut self, g: &[f32]) -> f64 {
        self.za.push_z(g[self.ta] as f64) - self.zb.push_z(g[self.tb] as f64)
    }
    /// Forget the sequence.
    pub fn clear(&mut self) {
        self.za.clear();
        self.zb.clear();
    }
}
