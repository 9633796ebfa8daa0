//! `epikv-raw` (the reference code's `hs_variance`): the undetrended band
//! score.
//!
//! Score s(t) = mean over the last W values of g_A − mean over the last W
//! values of g_B (including the current token's). Parameters: layers A, B
//! and W as for `epikv`. Kept as the ablation the z-score is measured
//! against.

use super::Rolling;

/// Rolling means of the two representative layers.
#[derive(Debug, Clone)]
pub struct Raw {
    ta: usize,
    tb: usize,
    ma: Rolling,
    mb: Rolling,
}

impl Raw {
    /// Layers at tap indices `ta`, `tb`, window `w`.
    pub fn new(ta: usize, tb: usize, w: usize) -> Raw {
        Raw {
            ta,
            tb,
            ma: Rolling::new(w),
            mb: Rolling::new(w),
        }
    }
    /// Score of a token whose per-tap g values are `g`.
    pub fn push(&mut self, g: &[f32]) -> f64 {
        self.ma.push(g[self.ta] as f64);
        self.mb.push(g[self.tb] as f64);
        self.ma.mean() - self.mb.mean()
    }
    /// Forget the sequence.
    pub fn clear(&mut self) {
        self.ma.clear();
        self.mb.clear();
    }
}
