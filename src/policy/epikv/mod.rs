//! EPIKV: epiphany-aware eviction from the change of the residual stream
//! (Kolawole & Smith, "Epiphany-Aware KV Cache Eviction Without the Attention
//! Matrix", arXiv 2606.26472; reference code stevenkolawole/epiphany-kv-cache).
//!
//! Signal: g_l(t) = ‖h_l(t) − h_l(t−1)‖₂ at the output of decoder layer l,
//! read from the forward pass through `HiddenTaps` (declared in `needs`;
//! only the previous token's vector per tapped layer is kept). On reasoning traces g in a middle band
//! of layers (A, ≈0.22–0.41 of depth) correlates positively with a token's
//! importance and g in an upper-middle band (B, ≈0.56–0.78) negatively, so
//! the scores are "A minus B". Every score is computed once, when the token
//! is written, from the tokens generated so far (causal), and never
//! refreshed. No attention probabilities are ever requested.
//!
//! The variants, one file each: [`flat`] (`epikv`, the default),
//! [`raw`] (`epikv-raw`), [`band`] (`epikv-band`), [`lag`] (`epikv-lag`,
//! the lag-normalized K/V variant) and [`seg`] (`epikv-seg`).
//!
//! Protection as published: prompt tokens are kept (the decode budget is
//! the budget minus the prompt), recent window 128 (at most budget/4), one
//! eviction per step once full. `--epikv-score-prompt` (an extension) scores
//! prompt tokens from the prefill pass's own hidden states instead, so long
//! prompts can be evicted too; `--prompt-policy` hands the prompt phase to
//! another policy.
//!
//! Layers: defaults are scaled by relative depth from the 32-layer
//! reference (A = 10, B = 21, bands 7–13 and 18–25); a calibrated per-model
//! JSON (`kvrun calibrate epikv`), found next to the model as
//! `<model stem>.epikv.json` or passed with `--epikv-config`, overrides the
//! scaling, and `--epikv-layers` / `--epikv-bands` / `--epikv-window`
//! override both.

pub mod band;
pub mod flat;
pub mod lag;
pub mod raw;
pub mod seg;

use super::{CacheShape, Entries, ModelView, ScoreCtx, Scorer, Step};
use crate::error::{Error, Field, Result};
use crate::signals::{HiddenTaps, Needs};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// ε of the rolling z-score.
pub const Z_EPS: f64 = 1e-6;
/// Default rolling window W.
pub const DEFAULT_WINDOW: usize = 64;

/// Causal rolling statistics over the last `w` values (including the newest):
/// O(1) per push with running sums, recomputed exactly every `w * 64`
/// pushes so floating-point drift stays bounded on very long traces.
#[derive(Debug, Clone)]
pub struct Rolling {
    w: usize,
    /// Ring of the last `w` values (grows as values come, so a window
    /// longer than the text costs only the text's values).
    buf: Vec<f64>,
    head: usize,
    len: usize,
    sum: f64,
    sumsq: f64,
    since_exact: usize,
}

impl Rolling {
    /// Empty statistics over windows of `w` ≥ 1 values.
    pub fn new(w: usize) -> Rolling {
        let w = w.max(1);
        Rolling {
            w,
            buf: Vec::new(),
            head: 0,
            len: 0,
            sum: 0.0,
            sumsq: 0.0,
            since_exact: 0,
        }
    }

    /// Forget every value.
    pub fn clear(&mut self) {
        *self = Rolling::new(self.w);
    }

    /// Number of values in the window.
    pub fn count(&self) -> usize {
        self.len
    }

    /// Add `x` as the newest value.
    pub fn push(&mut self, x: f64) {
        if self.len == self.w {
            let old = self.buf[self.head];
            self.sum -= old;
            self.sumsq -= old * old;
            self.buf[self.head] = x;
        } else {
            // not full yet: the ring's next slot is its end
            self.len += 1;
            self.buf.push(x);
        }
        self.head = (self.head + 1) % self.w;
        self.sum += x;
        self.sumsq += x * x;
        self.since_exact += 1;
        if self.since_exact >= self.w.saturating_mul(64) {
            self.sum = self.window().iter().sum();
            self.sumsq = self.window().iter().map(|v| v * v).sum();
            self.since_exact = 0;
        }
    }

    /// The values in the window (any order).
    fn window(&self) -> &[f64] {
        &self.buf[..self.len]
    }

    /// Mean of the window (0 when empty).
    pub fn mean(&self) -> f64 {
        if self.len == 0 {
            0.0
        } else {
            self.sum / self.len as f64
        }
    }

    /// Population standard deviation of the window.
    pub fn std(&self) -> f64 {
        if self.len == 0 {
            return 0.0;
        }
        let m = self.mean();
        (self.sumsq / self.len as f64 - m * m).max(0.0).sqrt()
    }

    /// Push `x` and return its z-score within the window that now ends with
    /// it: (x − μ)/(σ + ε), and 0 while fewer than two values exist.
    pub fn push_z(&mut self, x: f64) -> f64 {
        self.push(x);
        if self.len < 2 {
            return 0.0;
        }
        (x - self.mean()) / (self.std() + Z_EPS)
    }
}

/// Inclusive layer range.
pub type Band = (usize, usize);

/// Layers and window the EPIKV scores read. Serialized as the per-model
/// JSON config that `kvrun calibrate epikv` writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpikvLayers {
    /// Depth these layers were chosen for.
    pub n_layers: usize,
    /// Representative layers (A: positive, B: negative).
    pub layer_a: usize,
    pub layer_b: usize,
    /// Bands (inclusive) for `epikv-band`.
    pub band_a: Band,
    pub band_b: Band,
    /// Rolling window W.
    pub window: usize,
}

impl EpikvLayers {
    /// Defaults scaled by relative depth from the 32-layer reference:
    /// bands [0.22, 0.41]·L and [0.56, 0.78]·L, representatives
    /// round(10/32·L) and round(0.656·L) (the 32-layer settings of the EPIKV
    /// paper, arXiv 2606.26472).
    pub fn for_depth(n_layers: usize) -> EpikvLayers {
        let l = n_layers as f64;
        let at = |f: f64| ((f * l).round() as usize).min(n_layers.saturating_sub(1));
        EpikvLayers {
            n_layers,
            layer_a: at(10.0 / 32.0),
            layer_b: at(0.656),
            band_a: (at(0.22), at(0.41)),
            band_b: (at(0.56), at(0.78)),
            window: DEFAULT_WINDOW,
        }
    }

    /// Check every layer exists in a model of `n_layers` layers.
    pub fn validate(&self, n_layers: usize) -> Result<()> {
        let bad_in = |field: Field, what: &str| {
            Error::config(
                field,
                format!("{what} (the model has {n_layers} layers, 0-based)"),
            )
        };
        let bad = |what: &str| bad_in(Field::EpikvLayers, what);
        if self.layer_a >= n_layers || self.layer_b >= n_layers {
            return Err(bad(&format!(
                "layers {},{} out of range",
                self.layer_a, self.layer_b
            )));
        }
        for (a, b) in [self.band_a, self.band_b] {
            if a > b || b >= n_layers {
                return Err(bad_in(
                    Field::EpikvBands,
                    &format!("band {a}-{b} is empty or out of range"),
                ));
            }
        }
        if self.window == 0 {
            return Err(Error::config(Field::EpikvWindow, "must be at least 1"));
        }
        Ok(())
    }

    /// Read a per-model JSON config.
    pub fn load(path: &Path) -> Result<EpikvLayers> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        serde_json::from_str(&text)
            .map_err(|e| Error::config(Field::EpikvConfig, format!("{}: {e}", path.display())))
    }
}

/// Where the per-model config lives by default: next to the model file,
/// `<stem>.epikv.json`.
pub fn config_path_for(model: &Path) -> PathBuf {
    let stem = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    model.with_file_name(format!("{stem}.epikv.json"))
}

/// Command-line choices of the EPIKV family.
#[derive(Debug, Clone, Default)]
pub struct EpikvOptions {
    /// `--epikv-layers A,B`.
    pub layers: Option<(usize, usize)>,
    /// `--epikv-bands a0-a1,b0-b1`.
    pub bands: Option<(Band, Band)>,
    /// `--epikv-window W`.
    pub window: Option<usize>,
    /// A config read from `--epikv-config` or found next to the model.
    pub config: Option<EpikvLayers>,
    /// Score prompt tokens from the prefill's hidden states.
    pub score_prompt: bool,
}

impl EpikvOptions {
    /// The layers for a model of `n_layers` layers: overrides > config (if
    /// made for this depth) > depth scaling.
    pub fn resolve(&self, n_layers: usize) -> Result<EpikvLayers> {
        let mut l = match &self.config {
            Some(c) if c.n_layers == n_layers => c.clone(),
            Some(c) => {
                return Err(Error::config(
                    Field::EpikvConfig,
                    format!(
                        "config is for {} layers, the model has {n_layers}",
                        c.n_layers
                    ),
                ))
            }
            None => EpikvLayers::for_depth(n_layers),
        };
        if let Some((a, b)) = self.layers {
            l.layer_a = a;
            l.layer_b = b;
        }
        if let Some((a, b)) = self.bands {
            l.band_a = a;
            l.band_b = b;
        }
        if let Some(w) = self.window {
            l.window = w;
        }
        l.validate(n_layers)?;
        Ok(l)
    }
}

/// Parse `A,B`.
pub fn parse_layers(s: &str) -> Result<(usize, usize)> {
    let bad = || {
        Error::config(
            Field::EpikvLayers,
            format!("expected A,B (two layer indices), got '{s}'"),
        )
    };
    let (a, b) = s.split_once(',').ok_or_else(bad)?;
    Ok((
        a.trim().parse().map_err(|_| bad())?,
        b.trim().parse().map_err(|_| bad())?,
    ))
}

/// Parse `a0-a1,b0-b1`.
pub fn parse_bands(s: &str) -> Result<(Band, Band)> {
    let bad = || {
        Error::config(
            Field::EpikvBands,
            format!("expected a0-a1,b0-b1, got '{s}'"),
        )
    };
    let band = |t: &str| -> Result<Band> {
        let (x, y) = t.split_once('-').ok_or_else(bad)?;
        Ok((
            x.trim().parse().map_err(|_| bad())?,
            y.trim().parse().map_err(|_| bad())?,
        ))
    };
    let (a, b) = s.split_once(',').ok_or_else(bad)?;
    Ok((band(a)?, band(b)?))
}

/// Which EPIKV score (one registry row each: `epikv`, `epikv-raw`,
/// `epikv-band`, `epikv-lag`, `epikv-seg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    Flat,
    Raw,
    Band,
    Lag,
    Seg,
}

/// Per-variant state and the per-token score.
#[derive(Debug)]
enum Signal {
    Flat(flat::Flat),
    Raw(raw::Raw),
    Band(band::BandZ),
    Lag(lag::Lag),
    Seg(seg::Seg),
}

/// The EPIKV scorer (every variant): token-uniform, attention-free.
#[derive(Debug)]
pub struct Epikv {
    variant: Variant,
    opts: EpikvOptions,
    /// Resolved at `prepare`.
    layers: Option<EpikvLayers>,
    signal: Option<Signal>,
    /// Tapped layers, ascending (what `needs` declares).
    taps: Vec<usize>,
    /// The session's tapped layers (a superset of `taps` when several
    /// scorers share the taps) and the column of each of ours in them.
    bound: Vec<usize>,
    cols: Vec<usize>,
    /// One token's g at our taps, in `taps` order.
    g: Vec<f32>,
    /// (n_slots,) the score frozen when the slot's token was written.
    score: Vec<f32>,
}

impl Epikv {
    /// A scorer of `variant` (per-slot state is sized at `prepare`).
    pub fn new(variant: Variant, opts: EpikvOptions) -> Epikv {
        Epikv {
            variant,
            opts,
            layers: None,
            signal: None,
            taps: Vec::new(),
            bound: Vec::new(),
            cols: Vec::new(),
            g: Vec::new(),
            score: Vec::new(),
        }
    }

    /// The resolved layers (after `prepare`).
    pub fn layers(&self) -> Option<&EpikvLayers> {
        self.layers.as_ref()
    }

    /// The frozen score of `slot`.
    pub fn slot_score(&self, slot: u32) -> f32 {
        self.score[slot as usize]
    }

    /// Score the step's tokens from their hidden-state change (prompt
    /// tokens below `prompt_end` only with `score_prompt`).
    fn on_hidden(&mut self, taps: &HiddenTaps, slots: &[u32], positions: &[i64], prompt_end: i64) {
        if self.bound != taps.layers {
            self.cols.clear();
            for &l in &self.taps {
                debug_assert!(taps.col(l).is_some(), "layer {l} not tapped");
                self.cols.push(taps.col(l).unwrap_or(0));
            }
            self.bound.clone_from(&taps.layers);
        }
        for (i, (&slot, &pos)) in slots.iter().zip(positions).enumerate() {
            let s = &mut self.score[slot as usize];
            *s = 0.0;
            if (pos < prompt_end && !self.opts.score_prompt) || i < taps.first_valid {
                continue;
            }
            let row = taps.row(i);
            self.g.clear();
            self.g.extend(self.cols.iter().map(|&c| row[c]));
            let g = &self.g;
            *s = match &mut self.signal {
                Some(Signal::Flat(f)) => f.push(g),
                Some(Signal::Raw(r)) => r.push(g),
                Some(Signal::Band(b)) => b.push(g),
                Some(Signal::Seg(sg)) => sg.flat.push(g),
                Some(Signal::Lag(_)) | None => 0.0,
            } as f32;
        }
    }
}

/// Index of `layer` in the ascending tap list.
fn tap_index(taps: &[usize], layer: usize) -> usize {
    taps.binary_search(&layer).unwrap_or(0)
}

impl Scorer for Epikv {
    fn needs(&self) -> Needs {
        Needs::taps(self.taps.clone())
    }

    fn prepare(&mut self, m: &ModelView<'_>, cache: CacheShape) -> Result<()> {
        let c = m.config();
        let n_slots = cache.n_slots;
        let l = self.opts.resolve(c.n_layers)?;
        let (signal, taps) = match self.variant {
            Variant::Flat => {
                let taps = sorted(vec![l.layer_a, l.layer_b]);
                let s = flat::Flat::new(
                    tap_index(&taps, l.layer_a),
                    tap_index(&taps, l.layer_b),
                    l.window,
                );
                (Signal::Flat(s), taps)
            }
            Variant::Raw => {
                let taps = sorted(vec![l.layer_a, l.layer_b]);
                let s = raw::Raw::new(
                    tap_index(&taps, l.layer_a),
                    tap_index(&taps, l.layer_b),
                    l.window,
                );
                (Signal::Raw(s), taps)
            }
            Variant::Band => {
                let taps = sorted(
                    (l.band_a.0..=l.band_a.1)
                        .chain(l.band_b.0..=l.band_b.1)
                        .collect(),
                );
                let pick = |b: Band| (b.0..=b.1).map(|x| tap_index(&taps, x)).collect();
                let s = band::BandZ::new(pick(l.band_a), pick(l.band_b), l.window);
                (Signal::Band(s), taps)
            }
            Variant::Lag => (Signal::Lag(lag::Lag::new(n_slots, c.kv_dim())), Vec::new()),
            Variant::Seg => {
                let taps = sorted(vec![l.layer_a, l.layer_b]);
                let f = flat::Flat::new(
                    tap_index(&taps, l.layer_a),
                    tap_index(&taps, l.layer_b),
                    l.window,
                );
                (Signal::Seg(seg::Seg::new(f, n_slots)), taps)
            }
        };
        self.signal = Some(signal);
        self.taps = taps;
        self.bound.clear();
        self.score = vec![0.0; n_slots];
        self.layers = Some(l);
        Ok(())
    }

    fn observe(&mut self, step: &Step<'_>) {
        if let (Some(t), false) = (&step.signals.taps, self.taps.is_empty()) {
            self.on_hidden(t, step.slots, step.positions, step.prompt_end);
        }
        match &mut self.signal {
            Some(Signal::Lag(l)) => l.on_write(step.kv, step.slots),
            Some(Signal::Seg(s)) => s.on_write(step.kv, step.slots),
            _ => {}
        }
    }

    fn score(&mut self, ctx: &ScoreCtx<'_>, out: &mut [f32]) {
        let Entries::Tokens { slots, pos } = ctx.entries else {
            return;
        };
        match &mut self.signal {
            Some(Signal::Lag(l)) => l.score(slots, out),
            Some(Signal::Seg(s)) => {
                let newest = pos.last().copied().unwrap_or(0);
                let sctx = seg::SegContext {
                    prompt_end: if self.opts.score_prompt {
                        0
                    } else {
                        ctx.prompt_end
                    },
                    newest,
                    n_recent: ctx.rules.n_recent,
                    budget: ctx.rules.budget,
                };
                s.score(&self.score, slots, pos, &sctx, out)
            }
            _ => {
                for (o, &s) in out.iter_mut().zip(slots) {
                    *o = self.score[s as usize];
                }
            }
        }
    }

    fn relocate(&mut self, map: &[(u32, u32)], n_slots: usize) {
        super::relocate_slots(&mut self.score, 1, map, n_slots);
        match &mut self.signal {
            Some(Signal::Lag(l)) => l.relocate(map, n_slots),
            Some(Signal::Seg(s)) => s.relocate(map, n_slots),
            _ => {}
        }
    }

    fn reset(&mut self) {
        self.score.fill(0.0);
        match &mut self.signal {
            Some(Signal::Flat(f)) => f.clear(),
            Some(Signal::Raw(r)) => r.clear(),
            Some(Signal::Band(b)) => b.clear(),
            Some(Signal::Seg(s)) => s.flat.clear(),
            Some(Signal::Lag(l)) => l.clear(),
            None => {}
        }
    }
}

fn sorted(mut v: Vec<usize>) -> Vec<usize> {
    v.sort_unstable();
    v.dedup();
    v
}
