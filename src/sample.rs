//! Token sampling: greedy, temperature, top-k, top-p, min-p, repeat penalty.
//!
//! The chain runs in llama.cpp's default order: penalties → top-k → top-p →
//! min-p → temperature → draw. `temp <= 0` is greedy (argmax, ties to the
//! lowest id). The random generator is our own seeded xoshiro256**, so the
//! same seed gives the same output on every machine.

use crate::error::{Error, Field, Result};

/// Sampling parameters (llama.cpp defaults).
#[derive(Clone, Debug)]
pub struct SamplerConfig {
    pub temp: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0.0 = off.
    pub min_p: f32,
    /// 1.0 = off.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temp: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// The one range check of the sampling settings, shared by the command
    /// line and the server: temperature finite and ≥ 0 (0 is greedy), top-p and
    /// min-p in [0, 1], repeat penalty finite and above 0 (it divides
    /// logits). The error names the setting the way each front end does.
    pub fn validate(&self) -> Result<()> {
        if !(self.temp.is_finite() && self.temp >= 0.0) {
            return Err(Error::config(
                Field::Temp,
                format!(
                    "must be a finite number ≥ 0 (0 = greedy), got {}",
                    self.temp
                ),
            ));
        }
        for (f, v) in [(Field::TopP, self.top_p), (Field::MinP, self.min_p)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(Error::config(
                    f,
                    format!("must be between 0 and 1, got {v}"),
                ));
            }
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return Err(Error::config(
                Field::RepeatPenalty,
                format!("must be above 0 (1 = off), got {}", self.repeat_penalty),
            ));
        }
        Ok(())
    }
}

pub use crate::rng::Rng;

/// A stateful sampler (holds the RNG and the recent-token window).
#[derive(Clone, Debug)]
pub struct Sampler {
    pub cfg: SamplerConfig,
    rng: Rng,
    recent: Vec<u32>,
    cand: Vec<(u32, f32)>,
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler with its own RNG seeded from `cfg.seed`.
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = Rng::new(cfg.seed);
        Sampler {
            cfg,
            rng,
            recent: Vec::new(),
            cand: Vec::new(),
        }
    }

    /// Record a token that entered the context (prompt or generated).
    pub fn accept(&mut self, tok: u32) {
        self.recent.push(tok);
        let n = self.cfg.repeat_last_n;
        if self.recent.len() > 4 * n.max(16) {
            let cut = self.recent.len() - n;
            self.recent.drain(..cut);
        }
    }

    /// Pick the next token from `logits` (vocab,); `logits` is modified by
    /// the penalty step.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        // penalties
        if self.cfg.repeat_penalty != 1.0 && self.cfg.repeat_last_n > 0 {
            let start = self.recent.len().saturating_sub(self.cfg.repeat_last_n);
            let mut seen: Vec<u32> = self.recent[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / self.cfg.repeat_penalty
                    } else {
                        *l * self.cfg.repeat_penalty
                    };
                }
            }
        }
        if self.cfg.temp <= 0.0 {
            return argmax(logits);
        }
        // candidates sorted by logit, truncated by top-k
        let c = &mut self.cand;
        let k = if self.cfg.top_k == 0 {
            logits.len()
        } else {
            self.cfg.top_k.min(logits.len())
        };
        top_k_into(logits, k, c);
        // softmax of the survivors (temperature 1 for the filters, as llama.cpp)
        let probs = |c: &[(u32, f32)], t: f32| -> Vec<f64> {
            let mx = c[0].1 as f64;
            let e: Vec<f64> = c
                .iter()
                .map(|&(_, l)| ((l as f64 - mx) / t as f64).exp())
                .collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect()
        };
        // top-p: smallest prefix with cumulative probability ≥ p
        if self.cfg.top_p < 1.0 {
            let p = probs(c, 1.0);
            let mut cum = 0.0;
            let mut keep = c.len();
            for (i, &pi) in p.iter().enumerate() {
                cum += pi;
                if cum >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep.max(1));
        }
        // min-p: drop tokens below min_p times the top probability
        if self.cfg.min_p > 0.0 {
            let p = probs(c, 1.0);
            let thr = p[0] * self.cfg.min_p as f64;
            let keep = p.iter().take_while(|&&x| x >= thr).count();
            c.truncate(keep.max(1));
        }
        // temperature, then draw
        let p = probs(c, self.cfg.temp);
        let r = self.rng.next_f64();
        let mut cum = 0.0;
        for (i, &pi) in p.iter().enumerate() {
            cum += pi;
            if r < cum {
                return c[i].0;
            }
        }
        c[c.len() - 1].0
    }
}

/// The order of candidates: larger logit first (`total_cmp`, so a NaN
/// above +∞ and +0 above −0), the lower id first on ties.
fn rank(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// An integer with the order of `f32::total_cmp`.
#[inline]
fn total_key(l: f32) -> i32 {
    let b = l.to_bits() as i32;
    b ^ (((b >> 31) as u32) >> 1) as i32
}

/// The `k` (≥ 1, ≤ vocab) first candidates of `logits` in [`rank`]'s
/// order, sorted, into `c`. For a small `k` (top-k 40 of a 262144-token
/// vocabulary) one pass keeps the best seen so far plus a buffer of new
/// contenders, skipping every 64-logit chunk whose largest key does not
/// beat the k-th best (selecting among all `(id, logit)` pairs took 4% of
/// Gemma 3's decoding); the result is the same set in the same order.
fn top_k_into(logits: &[f32], k: usize, c: &mut Vec<(u32, f32)>) {
    let n = logits.len();
    c.clear();
    if k.saturating_mul(16) >= n {
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        if k < n {
            c.select_nth_unstable_by(k - 1, rank);
            c.truncate(k);
        }
    } else {
        // the first k, and the key of the worst of them: a later logit
        // (a larger id) is a contender only if its key is larger
        c.extend(logits[..k].iter().enumerate().map(|(i, &l)| (i as u32, l)));
        let worst = |c: &[(u32, f32)]| c.iter().map(|x| total_key(x.1)).min().unwrap_or(i32::MIN);
        let mut thr = worst(c);
        const CHUNK: usize = 64;
        let mut at = k;
        for chunk in logits[k..].chunks(CHUNK) {
            let top = chunk
                .iter()
                .map(|&l| total_key(l))
                .max()
                .unwrap_or(i32::MIN);
            if top > thr {
                for (j, &l) in chunk.iter().enumerate() {
                    if total_key(l) > thr {
                        c.push(((at + j) as u32, l));
                    }
                }
                // keep the buffer small: back to the k best
                if c.len() >= 4 * k + CHUNK {
                    c.select_nth_unstable_by(k - 1, rank);
                    c.truncate(k);
                    thr = worst(c);
                }
            }
            at += chunk.len();
        }
        if c.len() > k {
            c.select_nth_unstable_by(k - 1, rank);
            c.truncate(k);
        }
    }
    c.sort_unstable_by(rank);
}

/// Log-probabilities of one generated token: the log-softmax of the raw
/// logits it was drawn from (before penalties, top-k/top-p/min-p and
/// temperature, as vLLM reports them by default).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The token drawn.
    pub token: u32,
    /// Its log-probability (≤ 0).
    pub logprob: f32,
    /// The `k` most likely tokens with theirs, most likely first (ties:
    /// the lower id first, as `argmax`); the drawn token may be absent.
    pub top: Vec<(u32, f32)>,
}

/// The log-probability of `token` and of the `k` most likely tokens under
/// `logits` (vocab,). One pass keeps the top `k` in a small sorted list
/// (no sort of the vocabulary); the normaliser is a log-sum-exp in f64
/// around the largest logit. NaN logits are skipped.
pub fn logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let mx = logits
        .iter()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, |m, &l| m.max(l)) as f64;
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| (l as f64 - mx).exp())
        .sum();
    let lse = mx + sum.ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if l.is_nan() || (top.len() == k && l <= top[k - 1].1) {
                continue;
            }
            // after every entry with a logit ≥ l: earlier (lower) ids win ties
            let at = top.partition_point(|&(_, t)| t >= l);
            top.insert(at, (i as u32, l));
            top.truncate(k);
        }
    }
    TokenLogprobs {
        token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: top.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The top k by sorting everything.
    fn top_k_sorted(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
        let mut all: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        all.sort_by(rank);
        all.truncate(k);
        all
    }

    #[test]
    fn top_k_equals_a_full_sort() {
        let mut rng = Rng::new(7);
        let mut c = Vec::new();
        for n in [1usize, 5, 64, 700, 5000, 40000] {
            // ties from a coarse grid, ±0 and a few NaN and infinities
            let mut logits: Vec<f32> = (0..n)
                .map(|_| ((rng.next_f64() * 40.0).floor() - 20.0) as f32 / 4.0)
                .collect();
            for (i, v) in [-0.0f32, 0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY]
                .into_iter()
                .enumerate()
            {
                if n > 50 {
                    logits[(i * 7919 + 13) % n] = v;
                }
            }
            // rising logits: every chunk beats the threshold
            let rising: Vec<f32> = (0..n).map(|i| i as f32 * 1e-3).collect();
            for l in [&logits, &rising] {
                for k in [1usize, 2, 40, n / 3 + 1, n] {
                    let k = k.clamp(1, n);
                    top_k_into(l, k, &mut c);
                    let want = top_k_sorted(l, k);
                    assert_eq!(c.len(), k, "n {n} k {k}");
                    for (a, b) in c.iter().zip(&want) {
                        assert!(a.0 == b.0 && a.1.to_bits() == b.1.to_bits(), "n {n} k {k}");
                    }
                }
            }
        }
    }

    #[test]
    fn logprobs_match_a_full_sort() {
        // ties (1.5 twice) and a large spread, where f32 exp would overflow
        let logits: Vec<f32> = vec![0.0, 1.5, -3.0, 1.5, 120.0, 119.0, -1e4, 2.0];
        let r = logprobs(&logits, 2, 4);
        let lse = {
            let m = 120.0f64;
            m + logits
                .iter()
                .map(|&l| (l as f64 - m).exp())
                .sum::<f64>()
                .ln()
        };
        let mut want: Vec<(u32, f32)> = (0..logits.len() as u32)
            .map(|i| (i, (logits[i as usize] as f64 - lse) as f32))
            .collect();
        want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        assert_eq!(r.top, want[..4].to_vec());
        assert_eq!(r.token, 2);
        assert_eq!(r.logprob, (-3.0 - lse) as f32);
        assert!(r.top.iter().all(|&(_, l)| l <= 0.0));
        // the whole vocabulary sums to 1
        let all = logprobs(&logits, 0, logits.len());
        let s: f64 = all.top.iter().map(|&(_, l)| (l as f64).exp()).sum();
        assert!((s - 1.0).abs() < 1e-6, "{s}");
        // ties keep the lower id first, as argmax picks it
        let t = logprobs(&[1.0, 3.0, 3.0, 0.0], 1, 2);
        assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 0.0]), t.top[0].0);
        // k = 0 asks for the drawn token only
        assert!(logprobs(&logits, 4, 0).top.is_empty());
    }
}
