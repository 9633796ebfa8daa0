//! `epikv-band` (the reference code's `BandAdaptiveHSEviction`): z-scores
//! of band means.
//!
//! Per token, ḡ_A = mean of g_l over band A (layers 7–13 on 32 layers) and
//! ḡ_B over band B (18–25); each goes through the causal rolling z-score;
//! score s(t) = 1.29·z(ḡ_A) − 1.0·z(ḡ_B) (weights = ratio of the bands'
//! mean |Spearman ρ|, 0.141/0.109). Parameters: bands (`--epikv-bands`,
//! scaled by depth), W (`--epikv-window`).

use super::Rolling;

/// Weight of band A's z-score.
pub const W_A: f64 = 1.29;
/// Weight of band B's z-score.
pub const W_B: f64 = 1.0;

/// Rolling z-scores of the two band means.
#[derive(Debug, Clone)]
pub struct BandZ {
    /// Tap indices of the layers of each band.
    a: Vec<usize>,
    b: Vec<usize>,
    za: Rolling,
    zb: Rolling,
}

impl BandZ {
    /// Bands given as tap indices, window `w`.
    pub fn new(a: Vec<usize>, b: Vec<usize>, w: usize) -> BandZ {
        BandZ {
            a,
            b,
            za: Rolling::new(w),
            zb: Rolling::new(w),
        }
    }
    /// Score of a token whose per-tap g values are `g`.
    pub fn push(&mut self, g: &[f32]) -> f64 {
        let mean = |ix: &[usize]| ix.iter().map(|&i| g[i] as f64).sum::<f64>() / ix.len() as f64;
        W_A * self.za.push_z(mean(&self.a)) - W_B * self.zb.push_z(mean(&self.b))
    }
    /// Forget the sequence.
    pub fn clear(&mut self) {
        self.za.clear();
        self.zb.clear();
    }
}
