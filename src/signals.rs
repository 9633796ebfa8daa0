//! Signals: everything a forward step can hand to the eviction scorers,
//! as data.
//!
//! A scorer declares once, as a plain value ([`Needs`]), which signals it
//! reads; the session takes the union over every scorer it drives (the main
//! policy, the prompt-phase policy, an observer) and allocates exactly
//! that ([`Signals::for_needs`]). The forward pass fills what was allocated
//! and nothing else, so a policy that needs nothing costs nothing (no
//! attention-probability export, no copies of hidden states).
//!
//! The signals:
//! - [`HiddenTaps`]: the change of the residual stream between consecutive
//!   tokens at chosen layers (EPIKV).
//! - [`QueryWindow`]: the post-RoPE queries of the last w tokens at every
//!   layer (SnapKV-style observation windows).
//! - attention mass ([`MassMode`]): per cache slot, the attention
//!   probability of the step's last row, or summed over its rows, averaged
//!   over heads and layers (H2O, TOVA).
//! - [`AttnInputs`]: the attention block's input per layer (after the
//!   attention RMSNorm) for the step's tokens (learned retention gates).
//!
//! Read access to the weights a scorer may need once, at `prepare` (the
//! output projection W_O, for value-norm scoring), is the model layer's
//! `ModelView` (src/model/view.rs): signals sit below the model, which fills
//! them, and know its sizes only as [`Dims`].

/// Which attention probabilities a forward step exports (the attention
/// kernels' mode; the buffer is the same for both kinds, the mode is chosen
/// per step by the scorer that ranks in that step).
pub use crate::backend::MassMode;

/// What a scorer reads besides the cache itself. Declared once (after
/// `prepare`), never per step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// Decoder layers whose residual-stream change is tapped (ascending, unique).
    pub tap_layers: Vec<usize>,
    /// Query rows per layer kept for the scorer (0 = none).
    pub query_window: usize,
    /// Attention mass the scorer observes.
    pub mass: MassMode,
    /// Whether the attention block's inputs are recorded.
    pub attn_inputs: bool,
}

impl Needs {
    /// Nothing at all (the default).
    pub fn none() -> Needs {
        Needs::default()
    }

    /// Hidden-state taps at `layers` (sorted and deduplicated here).
    pub fn taps(mut layers: Vec<usize>) -> Needs {
        layers.sort_unstable();
        layers.dedup();
        Needs {
            tap_layers: layers,
            ..Needs::default()
        }
    }

    /// Attention mass of kind `mode`.
    pub fn mass(mode: MassMode) -> Needs {
        Needs {
            mass: mode,
            ..Needs::default()
        }
    }

    /// The last `w` query rows.
    pub fn queries(w: usize) -> Needs {
        Needs {
            query_window: w,
            ..Needs::default()
        }
    }

    /// Whether nothing is needed.
    pub fn is_none(&self) -> bool {
        *self == Needs::default()
    }

    /// Everything either side needs: tapped layers merged, the longer query
    /// window, the costlier mass export, attention inputs if either asks.
    pub fn union(&self, o: &Needs) -> Needs {
        let mut layers = self.tap_layers.clone();
        layers.extend_from_slice(&o.tap_layers);
        layers.sort_unstable();
        layers.dedup();
        Needs {
            tap_layers: layers,
            query_window: self.query_window.max(o.query_window),
            mass: self.mass.max(o.mass),
            attn_inputs: self.attn_inputs || o.attn_inputs,
        }
    }

    /// Whether `self` asks for nothing beyond `have`.
    pub fn covered_by(&self, have: &Needs) -> bool {
        self.tap_layers
            .iter()
            .all(|l| have.tap_layers.binary_search(l).is_ok())
            && self.query_window <= have.query_window
            && (self.mass == MassMode::None || have.mass != MassMode::None)
            && (!self.attn_inputs || have.attn_inputs)
    }
}

/// Residual-stream taps: the change of the hidden state between consecutive
/// positions at chosen decoder layers, g_l(t) = ‖h_l(t) − h_l(t−1)‖₂, where
/// h_l is the raw residual stream at the output of layer l. Only the
/// previous token's vector per tapped layer is kept; the whole stream is
/// never copied.
#[derive(Debug, Clone, Default)]
pub struct HiddenTaps {
    /// Tapped decoder layers (0-based), ascending.
    pub layers: Vec<usize>,
    /// (n_taps, dim) hidden state of the previous token at each tapped layer.
    prev: Vec<f32>,
    /// Whether `prev` holds a real previous token.
    has_prev: bool,
    /// (n, n_taps) g of the last step's tokens, row-major.
    pub g: Vec<f32>,
    /// Rows of `g` before this index have no previous token (the first
    /// token of a sequence); their g is 0.
    pub first_valid: usize,
}

impl HiddenTaps {
    /// Taps at `layers` (deduplicated, sorted) of a model with residual width `dim`.
    pub fn new(mut layers: Vec<usize>, dim: usize) -> HiddenTaps {
        layers.sort_unstable();
        layers.dedup();
        HiddenTaps {
            prev: vec![0.0; layers.len() * dim],
            layers,
            has_prev: false,
            g: Vec::new(),
            first_valid: 0,
        }
    }
    /// Forget the previous token (new sequence).
    pub fn reset(&mut self) {
        self.has_prev = false;
    }
    /// Number of tapped layers.
    pub fn n_taps(&self) -> usize {
        self.layers.len()
    }
    /// Column of `layer` in a row of `g`, if it is tapped.
    pub fn col(&self, layer: usize) -> Option<usize> {
        self.layers.binary_search(&layer).ok()
    }
    /// g of the step's token `i`, one value per tapped layer.
    pub fn row(&self, i: usize) -> &[f32] {
        let nt = self.layers.len();
        &self.g[i * nt..(i + 1) * nt]
    }

    /// Start a step of `n` tokens (the forward pass calls this first).
    pub(crate) fn begin_step(&mut self, n: usize) {
        self.g.clear();
        self.g.resize(n * self.n_taps(), 0.0);
        self.first_valid = usize::from(!self.has_prev);
    }

    /// Record g for the `n` rows of `x` (n, dim) at tap index `ti`, then keep
    /// the last row as the next step's previous vector.
    pub(crate) fn record(&mut self, ti: usize, x: &[f32], n: usize, dim: usize) {
        let nt = self.layers.len();
        for i in 0..n {
            let cur = &x[i * dim..(i + 1) * dim];
            let prev = if i == 0 {
                if !self.has_prev {
                    self.g[ti] = 0.0;
                    continue;
                }
                &self.prev[ti * dim..(ti + 1) * dim]
            } else {
                &x[(i - 1) * dim..i * dim]
            };
            let d2: f32 = cur.iter().zip(prev).map(|(a, b)| (a - b) * (a - b)).sum();
            self.g[i * nt + ti] = d2.sqrt();
        }
        self.prev[ti * dim..(ti + 1) * dim].copy_from_slice(&x[(n - 1) * dim..n * dim]);
    }

    /// End a step: the last token is now the previous one.
    pub(crate) fn end_step(&mut self) {
        self.has_prev = true;
    }
}

/// The post-RoPE queries of the last `w` tokens at every layer (SnapKV's
/// observation window): the scorers that vote with recent queries read them
/// when they rank, instead of any stored attention matrix. A ring of `w`
/// rows per layer; row order does not matter, positions say which keys
/// each row could see. Rows are allocated as tokens fill them, so a window
/// longer than the text costs only the text's rows (`--obs-window` is not
/// bounded by anything else).
#[derive(Debug, Clone, Default)]
pub struct QueryWindow {
    /// Rows kept per layer.
    pub w: usize,
    /// Query width (n_heads · head_dim).
    pub q_dim: usize,
    /// Layers recorded per row.
    n_layers: usize,
    /// (rows allocated, n_layers, q_dim) query rows; grows to w rows.
    rows: Vec<f32>,
    /// (rows allocated,) absolute position of each ring row.
    pos: Vec<i64>,
    /// Filled rows (≤ w).
    len: usize,
    /// Next ring row to overwrite.
    head: usize,
}

impl QueryWindow {
    /// A window of `w` rows for `n_layers` layers of `q_dim` queries.
    pub fn new(w: usize, n_layers: usize, q_dim: usize) -> QueryWindow {
        QueryWindow {
            w,
            q_dim,
            n_layers,
            rows: Vec::new(),
            pos: Vec::new(),
            len: 0,
            head: 0,
        }
    }
    /// Forget every row (new sequence).
    pub fn reset(&mut self) {
        self.len = 0;
        self.head = 0;
    }
    /// Rows held (≤ w).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Offset of ring row `r`'s query at `layer` in `rows`.
    #[inline]
    fn at(&self, layer: usize, r: usize) -> usize {
        (r * self.n_layers + layer) * self.q_dim
    }
    /// Row `r`'s (r < len) query at `layer`, (q_dim,), and its position.
    #[inline]
    pub fn row(&self, layer: usize, r: usize) -> (&[f32], i64) {
        let o = self.at(layer, r);
        (&self.rows[o..o + self.q_dim], self.pos[r])
    }
    /// Position of ring row `r` (r < len).
    #[inline]
    pub fn row_pos(&self, r: usize) -> i64 {
        self.pos[r]
    }
    /// The smallest position held (the window's first token), if any.
    pub fn first_pos(&self) -> Option<i64> {
        self.pos[..self.len].iter().copied().min()
    }
    /// The largest position held (the newest token), if any.
    pub fn last_pos(&self) -> Option<i64> {
        self.pos[..self.len].iter().copied().max()
    }
    /// Keep the last rows of `q` (n, q_dim) at `layer`, for tokens at
    /// `pos0..pos0+n`. Called for every layer of a step, layer 0 first.
    pub(crate) fn record(&mut self, layer: usize, q: &[f32], n: usize, pos0: usize) {
        if self.w == 0 {
            return;
        }
        let skip = n.saturating_sub(self.w);
        if layer == 0 {
            // the ring fills rows 0, 1, ... in order before it wraps, so the
            // rows this step writes are at most `len + n` of them
            let want = self.len.saturating_add(n - skip).min(self.w);
            if self.pos.len() < want {
                self.pos.resize(want, 0);
                self.rows.resize(want * self.n_layers * self.q_dim, 0.0);
            }
        }
        for (k, i) in (skip..n).enumerate() {
            let r = (self.head + k) % self.w;
            let o = self.at(layer, r);
            self.rows[o..o + self.q_dim].copy_from_slice(&q[i * self.q_dim..(i + 1) * self.q_dim]);
            if layer == 0 {
                self.pos[r] = (pos0 + i) as i64;
            }
        }
    }
    /// After the last layer of a step of `n` tokens: advance the ring.
    pub(crate) fn advance(&mut self, n: usize) {
        if self.w == 0 {
            return;
        }
        let k = n.min(self.w);
        self.head = (self.head + k) % self.w;
        self.len = (self.len + k).min(self.w);
    }
}

/// The attention block's input at every layer (the residual stream after
/// the attention RMSNorm) for the tokens of the last step: what a learned
/// retention gate reads (TRIM-KV). Holds one step at a time.
#[derive(Debug, Clone, Default)]
pub struct AttnInputs {
    pub n_layers: usize,
    pub dim: usize,
    /// Tokens per step at most.
    n_batch: usize,
    /// (n_layers, n_batch, dim) inputs; layer l's rows start at l · n_batch · dim.
    rows: Vec<f32>,
    /// Tokens of the last step.
    n: usize,
}

impl AttnInputs {
    /// Room for steps of up to `n_batch` tokens.
    pub fn new(n_layers: usize, n_batch: usize, dim: usize) -> AttnInputs {
        AttnInputs {
            n_layers,
            dim,
            n_batch,
            rows: vec![0.0; n_layers * n_batch * dim],
            n: 0,
        }
    }
    /// Tokens of the last step.
    pub fn n_tokens(&self) -> usize {
        self.n
    }
    /// Layer `l`'s inputs of the last step, (n, dim).
    pub fn layer(&self, l: usize) -> &[f32] {
        let o = l * self.n_batch * self.dim;
        &self.rows[o..o + self.n * self.dim]
    }
    /// Start a step of `n` tokens (n ≤ n_batch).
    pub(crate) fn begin_step(&mut self, n: usize) {
        self.n = n.min(self.n_batch);
    }
    /// Keep layer `l`'s normed inputs `xb` (n, dim).
    pub(crate) fn record(&mut self, l: usize, xb: &[f32]) {
        let o = l * self.n_batch * self.dim;
        let len = (self.n * self.dim).min(xb.len());
        self.rows[o..o + len].copy_from_slice(&xb[..len]);
    }
}

/// The signals a session owns: exactly what the union of its scorers'
/// `Needs` asked for (None = not allocated, never computed).
#[derive(Debug, Clone, Default)]
pub struct Signals {
    /// What was allocated.
    needs: Needs,
    pub taps: Option<HiddenTaps>,
    pub queries: Option<QueryWindow>,
    pub attn_inputs: Option<AttnInputs>,
    /// (n_slots,) attention mass of the last step (when some scorer needs it).
    pub mass: Option<Vec<f32>>,
}

/// The model sizes the signal buffers depend on (from the model's
/// `Config`: `Dims::from(&config)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Decoder layers.
    pub n_layers: usize,
    /// Residual-stream width.
    pub dim: usize,
    /// Query width (query heads × head size).
    pub q_dim: usize,
}

impl Signals {
    /// Buffers for `needs` on a model `c`, a cache of `n_slots` slots and
    /// steps of at most `n_batch` tokens.
    pub fn for_needs(needs: &Needs, c: Dims, n_slots: usize, n_batch: usize) -> Signals {
        let mut s = Signals::default();
        s.grow(needs, c, n_slots, n_batch);
        s
    }

    /// Allocate what `needs` asks for and is not there yet (existing
    /// signals keep their state).
    pub fn grow(&mut self, needs: &Needs, c: Dims, n_slots: usize, n_batch: usize) {
        if needs.covered_by(&self.needs) {
            return;
        }
        let all = self.needs.union(needs);
        if all.tap_layers != self.needs.tap_layers {
            self.taps = Some(HiddenTaps::new(all.tap_layers.clone(), c.dim));
        }
        if all.query_window != self.needs.query_window {
            self.queries = Some(QueryWindow::new(all.query_window, c.n_layers, c.q_dim));
        }
        if all.attn_inputs && self.attn_inputs.is_none() {
            self.attn_inputs = Some(AttnInputs::new(c.n_layers, n_batch, c.dim));
        }
        if all.mass != MassMode::None && self.mass.is_none() {
            self.mass = Some(vec![0.0; n_slots]);
        }
        self.needs = all;
    }

    /// The cache now has `n_slots` slots (re-laid out): the per-slot mass
    /// buffer follows (its contents are per step).
    pub fn resize_slots(&mut self, n_slots: usize) {
        if let Some(m) = &mut self.mass {
            m.clear();
            m.resize(n_slots, 0.0);
        }
    }

    /// What is allocated.
    pub fn needs(&self) -> &Needs {
        &self.needs
    }

    /// Forget the sequence (previous token, recent queries).
    pub fn reset(&mut self) {
        if let Some(t) = &mut self.taps {
            t.reset();
        }
        if let Some(q) = &mut self.queries {
            q.reset();
        }
    }

    /// Mutable views for one forward step exporting attention mass of kind
    /// `mass_mode` (ignored when no mass buffer is allocated).
    pub fn step(&mut self, mass_mode: MassMode) -> StepSignals<'_> {
        let mass = match (&mut self.mass, mass_mode) {
            (Some(m), mode) if mode != MassMode::None => Some(&mut m[..]),
            _ => None,
        };
        StepSignals {
            mass_mode: if mass.is_some() {
                mass_mode
            } else {
                MassMode::None
            },
            mass,
            taps: self.taps.as_mut(),
            queries: self.queries.as_mut(),
            attn_inputs: self.attn_inputs.as_mut(),
        }
    }
}

/// What one forward step fills (every part optional; `Default` = nothing).
#[derive(Debug, Default)]
pub struct StepSignals<'a> {
    /// Attention-probability export mode (`None` unless `mass` is given).
    pub mass_mode: MassMode,
    /// (n_slots,) receives, per slot, the attention probability averaged
    /// over every query head of every layer (summed over rows for `AllRows`).
    pub mass: Option<&'a mut [f32]>,
    /// Residual-stream taps to fill.
    pub taps: Option<&'a mut HiddenTaps>,
    /// Query rows to keep.
    pub queries: Option<&'a mut QueryWindow>,
    /// Attention-block inputs to keep.
    pub attn_inputs: Option<&'a mut AttnInputs>,
}
