//! Wrappers: rescore what any scorer produced (kvpress's presses that wrap
//! a press, e.g. CriticalKV re-ranking SnapKV/AdaKV/H2O/TOVA scores by the
//! value-projected norm ‖V·W_O‖).
//!
//! A [`Rescorer`] sees everything its inner scorer sees (the same `Step`s
//! and `ScoreCtx`, so the group budget and protection rules), the model at
//! `prepare` (`ModelView`: e.g. each layer's W_O), and the inner scores of
//! the entries being ranked, which it rewrites in place. [`Wrapped`] makes
//! the pair a `Scorer`: its needs are the union of both, its layout the
//! inner scorer's. Wrapping composes (a `Wrapped` is a scorer too).

use super::{CacheShape, ModelView, ScoreCtx, Scorer, Step};
use crate::error::Result;
use crate::signals::Needs;

/// Rewrites an inner scorer's scores.
pub trait Rescorer: std::fmt::Debug + Send {
    /// Signals it reads besides the inner scorer's (default: none).
    fn needs(&self) -> Needs {
        Needs::none()
    }
    /// Resolve model-dependent settings (weights are readable here).
    fn prepare(&mut self, _model: &ModelView<'_>, _cache: CacheShape) -> Result<()> {
        Ok(())
    }
    /// A forward step wrote new tokens.
    fn observe(&mut self, _step: &Step<'_>) {}
    /// `out` holds the inner scores of `ctx.entries` (stream layouts: only
    /// the wanted streams' ranges are fresh); rewrite them, higher = keep.
    fn rescore(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]);
    /// Forget per-sequence state.
    fn reset(&mut self) {}
    /// Follow a cache re-layout (see `Scorer::relocate`).
    fn relocate(&mut self, _map: &[(u32, u32)], _n_slots: usize) {}
}

/// A scorer whose scores pass through a rescorer.
#[derive(Debug)]
pub struct Wrapped<R> {
    pub inner: Box<dyn Scorer>,
    pub outer: R,
}

impl<R: Rescorer> Wrapped<R> {
    /// `inner` rescored by `outer`.
    pub fn new(inner: Box<dyn Scorer>, outer: R) -> Wrapped<R> {
        Wrapped { inner, outer }
    }
}

impl<R: Rescorer> Scorer for Wrapped<R> {
    fn needs(&self) -> Needs {
        self.inner.needs().union(&self.outer.needs())
    }
    fn per_stream(&self) -> bool {
        self.inner.per_stream()
    }
    fn prepare(&mut self, model: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        self.inner.prepare(model, cache)?;
        self.outer.prepare(model, cache)
    }
    fn observe(&mut self, step: &Step<'_>) {
        self.inner.observe(step);
        self.outer.observe(step);
    }
    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        self.inner.score(ctx, out);
        self.outer.rescore(ctx, out);
    }
    fn reset(&mut self) {
        self.inner.reset();
        self.outer.reset();
    }
    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        self.inner.relocate(map, n_slots);
        self.outer.relocate(map, n_slots);
    }
}
