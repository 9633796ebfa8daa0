//! `trimkv`, `dbtrimkv`: learned retention (Bui et al., 2025, "Cache What
//! Lasts: Token Retention for Memory-Bounded KV Cache in LLMs", arXiv
//! 2512.03324; and "Make Each Token Count", arXiv 2605.09649, DBTrimKV).
//!
//! Idea: a small gate per layer (`gates.rs`) reads the attention block's
//! input when a token is written and predicts, per KV head, how slowly the
//! token's usefulness decays: β ∈ (0, 1), retention β^(age). Only log β and
//! the position are kept per entry; no attention is read, ever. At an
//! eviction event at step t every entry scores its log-retention at the next
//! query, (t + 1 − pos) · log β (≤ 0, higher = keep); rankings change over
//! time because slopes differ, so scores are recomputed at every event
//! (O(n), cheap). With `--trim-lookahead n` > 1 the score is the log of the
//! retention summed over the next n queries, log Σ_{k<n} β^(a+k) =
//! a·log β + log(1 − β^n) − log(1 − β).
//!
//! Budget: `trimkv` keeps a fixed budget per (layer, KV head); `dbtrimkv`
//! keeps one global budget of L·Hkv·M entries for all layers and heads
//! (`BudgetRule::Global`), each stream ending with whatever survives the
//! global ranking (floor `--min-per-head F`); the shared scoring head of
//! the `rg10` gates puts every layer on one scale. The buffer of the
//! reference (evict when M + buffer is reached, back to M) is
//! `--evict-every`. The gates come from `--gates PATH`, by default
//! `<model stem>.gates.safetensors` next to the model; `kvrun train gates`
//! makes them.
//!
//! Parameters: `--gates`, `--min-per-head` (dbtrimkv, default 0),
//! `--trim-lookahead` (default 1); no sinks or recent window beyond the
//! shared `--kv-sink` (4) unless asked (`--kv-recent`, default 0): the
//! paper finds the gates rediscover them.

use super::gates::{GateNet, Gates};
use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer, Step};
use crate::error::Result;
use crate::signals::Needs;
use std::sync::Arc;

/// log(1 − e^x) for x < 0, stable near 0 and far below it.
#[inline]
pub fn log1mexp(x: f32) -> f32 {
    let x = x.min(-1e-9);
    if x > -std::f32::consts::LN_2 {
        (-x.exp_m1()).ln()
    } else {
        (-x.exp()).ln_1p()
    }
}

/// The score of an entry of log-retention rate `lb` at age `a` (next query
/// position − its position), summed over `lookahead` queries.
#[inline]
pub fn retention_score(lb: f32, a: f32, lookahead: usize) -> f32 {
    if lookahead <= 1 {
        a * lb
    } else {
        let lb = lb.min(-1e-9);
        a * lb + log1mexp(lookahead as f32 * lb) - log1mexp(lb)
    }
}

/// Learned-retention scores per (layer, KV head) stream entry.
#[derive(Debug)]
pub struct Retention {
    /// The gates, weights in f16.
    pub net: GateNet,
    /// Queries the score looks ahead over (1 = the next one).
    pub lookahead: usize,
    /// (n_slots,) log β of each pool row's entry.
    log_beta: Vec<f32>,
    /// (n_layers, n_batch, n_kv_heads) log β of the last step.
    step: Vec<f32>,
    /// The gate MLP's per-thread scratch.
    scratch: Vec<f32>,
}

impl Retention {
    /// Scores from `gates`.
    pub fn new(gates: Arc<Gates>, lookahead: usize) -> Retention {
        Retention {
            net: GateNet::new(gates),
            lookahead: lookahead.max(1),
            log_beta: Vec::new(),
            step: Vec::new(),
            scratch: Vec::new(),
        }
    }
}

impl Scorer for Retention {
    fn needs(&self) -> Needs {
        Needs {
            attn_inputs: true,
            ..Needs::none()
        }
    }
    fn per_stream(&self) -> bool {
        true
    }
    fn prepare(&mut self, m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        let c = m.config();
        self.net
            .gates
            .check_model(c.n_cache_layers(), c.dim, c.n_kv_heads)?;
        self.log_beta = vec![0.0; cache.n_slots];
        Ok(())
    }
    fn observe(&mut self, step: &Step<'_>) {
        let Some(ai) = step.signals.attn_inputs.as_ref() else {
            return;
        };
        let g = &*self.net.gates;
        let n = step.positions.len().min(ai.n_tokens());
        let (nl, nkv) = (g.n_layers, g.n_kv_heads);
        if n == 0 || step.slots.len() < nl * nkv * n {
            return;
        }
        // log β of every new entry, layers dealt over the threads
        self.step.resize(nl * n * nkv, 0.0);
        self.net.log_beta_all(
            step.pool,
            |l| ai.layer(l),
            n,
            &mut self.step,
            &mut self.scratch,
        );
        // stream s = l · Hkv + h wrote token i into slots[s · n + i]
        for l in 0..nl {
            for h in 0..nkv {
                let s = l * nkv + h;
                for i in 0..n {
                    let slot = step.slots[s * n + i] as usize;
                    if let Some(v) = self.log_beta.get_mut(slot) {
                        *v = self.step[(l * n + i) * nkv + h];
                    }
                }
            }
        }
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        let Entries::Streams { want, off, .. } = ctx.entries else {
            return;
        };
        let Some(st) = ctx.kv.streams() else {
            return;
        };
        let next = ctx.newest + 1;
        for s in (0..st.n_streams()).filter(|&s| want[s]) {
            let (slots, pos) = st.stream(s);
            for (j, (&sl, &p)) in slots.iter().zip(pos).enumerate() {
                let lb = self.log_beta[sl as usize];
                out[off[s] + j] = retention_score(lb, (next - p) as f32, self.lookahead);
            }
        }
    }
    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        super::relocate_slots(&mut self.log_beta, 1, map, n_slots);
    }
}
