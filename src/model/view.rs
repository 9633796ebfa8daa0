//! Read access to the model for scorers, at `prepare`: its configuration
//! and the weights a score needs once (the output projection W_O for
//! value-norm scoring), read back to the host from wherever the backend
//! keeps them.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::{Config, Weights};
use crate::signals::Dims;
use crate::tensor::DType;

impl From<&Config> for Dims {
    fn from(c: &Config) -> Dims {
        Dims {
            // queries and attention inputs are kept per cache layer
            n_layers: c.n_cache_layers(),
            dim: c.dim,
            q_dim: c.q_dim(),
        }
    }
}

/// Weights a scorer may read at `prepare`, read back to the host from
/// wherever the backend keeps them.
pub trait WeightSource {
    /// Layer `l`'s output projection W_O into `out`, (dim, q_dim) row-major.
    fn wo_f32(&self, l: usize, out: &mut Vec<f32>) -> Result<()>;
    /// Layer `l`'s W_O as the file stores it (dim rows of q_dim values in
    /// the returned type's block layout), where the source can hand it
    /// out; `None` otherwise (`wo_f32` then).
    fn wo_bytes(&self, l: usize, out: &mut Vec<u8>) -> Result<Option<DType>> {
        let _ = (l, out);
        Ok(None)
    }
}

/// The weights of backend `B`, read through it.
#[derive(Debug)]
pub struct BackendWeights<'s, 'w, B: Backend> {
    backend: &'s B,
    weights: &'s Weights<'w, B>,
}

impl<'s, 'w, B: Backend> BackendWeights<'s, 'w, B> {
    /// `w` as `backend` holds them.
    pub fn new(backend: &'s B, weights: &'s Weights<'w, B>) -> Self {
        BackendWeights { backend, weights }
    }
}

impl<B: Backend> WeightSource for BackendWeights<'_, '_, B> {
    fn wo_f32(&self, l: usize, out: &mut Vec<f32>) -> Result<()> {
        let lw = self
            .weights
            .layers
            .get(l)
            .ok_or_else(|| Error::Other(format!("layer {l} out of range")))?;
        let (rows, cols) = self.backend.mat_shape(&lw.wo);
        out.clear();
        out.resize(rows * cols, 0.0);
        for (i, row) in out.chunks_exact_mut(cols.max(1)).enumerate() {
            self.backend.mat_row(&lw.wo, i, row);
        }
        Ok(())
    }

    fn wo_bytes(&self, l: usize, out: &mut Vec<u8>) -> Result<Option<DType>> {
        let lw = self
            .weights
            .layers
            .get(l)
            .ok_or_else(|| Error::Other(format!("layer {l} out of range")))?;
        Ok(self.backend.mat_bytes(&lw.wo, out))
    }
}

/// Read access to the model for scorers, at `prepare`: the configuration
/// and the weights a score needs once (on a device backend, a read-back).
#[derive(Clone, Copy)]
pub struct ModelView<'a> {
    config: &'a Config,
    weights: Option<&'a dyn WeightSource>,
}

impl std::fmt::Debug for ModelView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelView")
            .field("config", self.config)
            .field("weights", &self.weights.is_some())
            .finish()
    }
}

impl<'a> ModelView<'a> {
    /// The model `config` whose weights `weights` reads.
    pub fn new(config: &'a Config, weights: &'a dyn WeightSource) -> ModelView<'a> {
        ModelView {
            config,
            weights: Some(weights),
        }
    }

    /// A configuration without weights (scorers that only need shapes;
    /// tests on hand-built configurations).
    pub fn config_only(c: &'a Config) -> ModelView<'a> {
        ModelView {
            config: c,
            weights: None,
        }
    }

    /// The model's hyperparameters.
    pub fn config(&self) -> &'a Config {
        self.config
    }

    /// Layer `l`'s output projection W_O dequantized into `out`, (dim,
    /// q_dim) row-major: row i holds the weights of output channel i, so
    /// head h's block is columns h·head_dim..(h+1)·head_dim.
    ///
    /// `l` counts cache layers (`Config::cache_layers`), as scorers do: on a
    /// model with sliding-window layers it is mapped to its model layer.
    pub fn wo_f32(&self, l: usize, out: &mut Vec<f32>) -> Result<()> {
        let (src, layer) = self.source(l)?;
        src.wo_f32(layer, out)
    }

    /// Cache layer `l`'s W_O as the file stores it, where the weights can
    /// be handed out so (see [`WeightSource::wo_bytes`]).
    pub fn wo_bytes(&self, l: usize, out: &mut Vec<u8>) -> Result<Option<DType>> {
        let (src, layer) = self.source(l)?;
        src.wo_bytes(layer, out)
    }

    /// The weights and the model layer of cache layer `l`.
    fn source(&self, l: usize) -> Result<(&'a dyn WeightSource, usize)> {
        let layer = match self.config.features.swa {
            Some(_) => *self
                .config
                .cache_layers()
                .get(l)
                .ok_or_else(|| Error::Other(format!("cache layer {l} out of range")))?,
            None => l,
        };
        let src = self
            .weights
            .ok_or_else(|| Error::Other("model view has no weights (config only)".into()))?;
        Ok((src, layer))
    }
}
