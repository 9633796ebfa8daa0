//! `expected-attention`: kvpress's Expected Attention (Devoto et al., 2025,
//! "Expected Attention: KV Cache Compression by Estimating Attention from
//! Future Queries Distribution", arXiv 2510.00636; kvpress
//! ExpectedAttentionPress).
//!
//! Idea: the attention an entry will receive can be estimated without
//! seeing the future queries, from their statistics. Model the pre-RoPE
//! queries of a head as Gaussian, q ~ N(μ, Σ), estimated from recent
//! queries. A future query at position t + k is R(t+k)·q; averaged over the
//! next K positions its rotation is R̄ = (1/K) Σ_k R(t+k) (per RoPE pair a
//! rotation scaled by |mean of e^{i(t+k)ω}|), so the future query has mean
//! μ' = R̄μ and covariance Σ' = R̄ΣR̄ᵀ. For a stored (post-RoPE) key k the
//! expected exponentiated logit is E[exp(q'·k/√d)] = exp(μ'·k/√d +
//! kᵀΣ'k/(2d)) (the Gaussian moment generating function), so
//!
//!   score_j = mean over the g query heads of softmax_j(μ'·k_j/√d +
//!             k_jᵀΣ'k_j/(2d)) · ‖v_j‖₂
//!
//! per (layer, KV head) stream (GQA: the mean over the group, as kvpress).
//! The value norm weighs how much an entry would change the output.
//!
//! No d×d matrix and no attention matrix: Σ is the sample covariance of
//! the m window rows u_r = q_r − μ, so kᵀΣ'k = (1/m) Σ_r (R̄u_r · k)²
//! exactly, at m·d per key (kvpress builds Σ explicitly, d²).
//!
//! Signals: the post-RoPE queries of the last m tokens per layer
//! (`QueryWindow`, from the forward pass), rotated back by their own
//! positions (R(−p)) to pre-RoPE queries; the RoPE parameters come from
//! the model config (per-pair frequency factors, used by Llama 3.1, are not
//! in the config and are ignored: an approximation for those models only).
//!
//! Parameters and choices: the statistics use the window's rows past the
//! first n_sink = 4 positions (kvpress's `n_sink`); K = 512 future
//! positions (`n_future_positions`); m = `--obs-window` (default 64: kvpress
//! decodes with a 256 hidden-state buffer, the cost of a window is m·d per
//! key and head at every event); ε = 0 (kvpress's default) added before the
//! value norm; sinks are the evictor's (4). Cadence: the original
//! compresses after prefill (decoding: every 512 steps); kvrun keeps the
//! budget at every moment, rescoring at each eviction event with the
//! current window and freeing `--evict-every` entries per stream (default
//! budget/8, at most 128).

use super::streams::for_each_wanted;
use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer};
use crate::backend::{Rope, RopeStyle};
use crate::error::{Error, Field, Result};
use crate::signals::Needs;

/// Future positions the query rotation is averaged over.
pub const N_FUTURE: usize = 512;
/// Leading positions left out of the query statistics.
pub const N_SINK: i64 = 4;
/// Default window of query rows.
pub const DEFAULT_WINDOW: usize = 64;

/// Expected-attention scores per (layer, KV head) stream entry.
#[derive(Debug)]
pub struct ExpectedAttention {
    /// Query rows the statistics use.
    pub window: usize,
    /// RoPE of the model (set at `prepare`).
    rope: Option<Rope>,
    /// Per RoPE pair, the angle per position ω_i (set at `prepare`).
    omega: Vec<f32>,
}

impl ExpectedAttention {
    /// Statistics over the last `window` query rows (≥ 2: one row has no
    /// covariance).
    pub fn new(window: usize) -> Result<ExpectedAttention> {
        if window < 2 {
            return Err(Error::config(
                Field::ObsWindow,
                format!("expected-attention needs at least 2 query rows, got {window}"),
            ));
        }
        Ok(ExpectedAttention {
            window,
            rope: None,
            omega: Vec::new(),
        })
    }
}

/// The averaged rotation R̄ over positions t+1..=t+K, per RoPE pair i:
/// (c_i, s_i) = mean_k (cos, sin)((t+k)·ω_i).
pub fn mean_rotation(omega: &[f32], t: i64, k: usize, out: &mut Vec<(f32, f32)>) {
    out.clear();
    for &w in omega {
        let w = w as f64;
        let (mut c, mut s) = (0f64, 0f64);
        for j in 1..=k {
            let a = (t as f64 + j as f64) * w;
            c += a.cos();
            s += a.sin();
        }
        out.push(((c / k as f64) as f32, (s / k as f64) as f32));
    }
}

/// Apply the per-pair scaled rotations `cs` to one head `x` (head_dim) laid
/// out by `style` (dims beyond the rotated pairs stay as they are).
pub fn rotate_pairs(x: &mut [f32], cs: &[(f32, f32)], style: RopeStyle) {
    let half = cs.len();
    for (i, &(c, s)) in cs.iter().enumerate() {
        let (a, b) = match style {
            RopeStyle::Normal => (2 * i, 2 * i + 1),
            RopeStyle::Neox => (i, i + half),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

/// Per-thread scratch of one stream.
#[derive(Default)]
struct Scratch {
    /// (hd, n) keys, transposed.
    kt: Vec<f32>,
    /// (n, hd) values.
    vals: Vec<f32>,
    /// (m, hd) pre-RoPE queries of one head, then R̄(q − μ).
    u: Vec<f32>,
    /// (hd,) μ'.
    mu: Vec<f32>,
    /// (n,) logits, one projection, the group mean.
    lg: Vec<f32>,
    proj: Vec<f32>,
    acc: Vec<f32>,
}

impl Scorer for ExpectedAttention {
    fn needs(&self) -> Needs {
        Needs::queries(self.window)
    }
    fn per_stream(&self) -> bool {
        true
    }
    fn prepare(&mut self, m: &ModelView<'_>, _cache: CacheShape) -> Result<()> {
        let c = m.config();
        let rope = Rope::new(c.rope_style, c.n_rot, c.rope_base, None, c.rope_pos_scale);
        // pair i's angle at position p is p · θ^i · pos_scale (Rope::apply_at)
        let mut w = 1f32;
        self.omega = (0..c.n_rot / 2)
            .map(|_| {
                let o = w * rope.pos_scale;
                w *= rope.theta_scale;
                o
            })
            .collect();
        self.rope = Some(rope);
        Ok(())
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        let (Entries::Streams { want, off, plan }, Some(qw), Some(rope)) = (
            ctx.entries,
            ctx.signals.queries.as_ref(),
            self.rope.as_ref(),
        ) else {
            return;
        };
        let Some(st) = ctx.kv.streams() else {
            return;
        };
        let (hd, nkv) = (ctx.kv.head_dim, plan.n_kv_heads);
        let group = qw.q_dim / hd / nkv;
        // the statistics' rows: the last `window` positions, sinks left out
        let lo = qw
            .last_pos()
            .map_or(i64::MIN, |p| super::snapkv::window_start(p, self.window))
            .max(N_SINK);
        let rows: Vec<usize> = (0..qw.len()).filter(|&r| qw.row_pos(r) >= lo).collect();
        let mut cs = Vec::new();
        mean_rotation(&self.omega, ctx.newest, N_FUTURE, &mut cs);
        let style = rope.style;
        let scale = 1.0 / (hd as f32).sqrt();
        let kv = ctx.kv;
        for_each_wanted(ctx.pool, want, off, out, |s, a, sc: &mut Scratch| {
            let (l, g) = (s / nkv, s % nkv);
            let (slots, _) = st.stream(s);
            let n = slots.len();
            if n == 0 {
                return;
            }
            sc.vals.resize(n * hd, 0.0);
            kv.read_heads(true, l, g, slots, &mut sc.vals);
            sc.kt.resize(n * hd, 0.0);
            for (j, k) in sc.vals.chunks_exact(hd).enumerate() {
                for (d, &x) in k.iter().enumerate() {
                    sc.kt[d * n + j] = x;
                }
            }
            sc.acc.clear();
            sc.acc.resize(n, 0.0);
            let m = rows.len();
            if m == 0 {
                // no statistics yet: every entry alike (the evictor's tie
                // rule then drops the oldest)
                a.fill(0.0);
                return;
            }
            for h in 0..group {
                let qh = (g * group + h) * hd;
                // pre-RoPE queries of this head, their mean
                sc.u.resize(m * hd, 0.0);
                sc.mu.clear();
                sc.mu.resize(hd, 0.0);
                for (i, &r) in rows.iter().enumerate() {
                    let (q, p) = qw.row(l, r);
                    let u = &mut sc.u[i * hd..(i + 1) * hd];
                    u.copy_from_slice(&q[qh..qh + hd]);
                    rope.apply_at(u, 1, hd, -(p as f32));
                    for (mu, &x) in sc.mu.iter_mut().zip(u.iter()) {
                        *mu += x / m as f32;
                    }
                }
                // u_r = R̄(q_r − μ), μ' = R̄μ
                for u in sc.u.chunks_exact_mut(hd) {
                    for (x, &mu) in u.iter_mut().zip(&sc.mu) {
                        *x -= mu;
                    }
                    rotate_pairs(u, &cs, style);
                }
                rotate_pairs(&mut sc.mu, &cs, style);
                // logits: μ'·k/√d + (1/(2d)) (1/m) Σ_r (u_r·k)²
                sc.lg.clear();
                sc.lg.resize(n, 0.0);
                for (d, &mu) in sc.mu.iter().enumerate() {
                    let mu = mu * scale;
                    for (y, &k) in sc.lg.iter_mut().zip(&sc.kt[d * n..(d + 1) * n]) {
                        *y += mu * k;
                    }
                }
                let w2 = 1.0 / (2.0 * hd as f32 * m as f32);
                for u in sc.u.chunks_exact(hd) {
                    sc.proj.clear();
                    sc.proj.resize(n, 0.0);
                    for (d, &ud) in u.iter().enumerate() {
                        for (y, &k) in sc.proj.iter_mut().zip(&sc.kt[d * n..(d + 1) * n]) {
                            *y += ud * k;
                        }
                    }
                    for (y, &p) in sc.lg.iter_mut().zip(&sc.proj) {
                        *y += w2 * p * p;
                    }
                }
                super::rkv::softmax(&mut sc.lg);
                for (y, &p) in sc.acc.iter_mut().zip(&sc.lg) {
                    *y += p / group as f32;
                }
            }
            // × ‖v‖₂
            kv.read_heads(false, l, g, slots, &mut sc.vals);
            for ((o, &p), v) in a.iter_mut().zip(&sc.acc).zip(sc.vals.chunks_exact(hd)) {
                *o = p * v.iter().map(|x| x * x).sum::<f32>().sqrt();
            }
        });
    }
}
