//! The NVIDIA backend.
//!
//! - [`plan`]: the host-side decisions (type codes, launch shapes, the
//!   attention records of a layer, split-K), plain Rust tested everywhere.
//! - With the `cuda` feature (the default): [`Cuda`], kvrun's own kernels
//!   (kernels/*.cu, PTX embedded by build.rs) launched through the driver
//!   API, loaded at run time, so the binary builds and runs on machines
//!   without CUDA and `--device cuda` there is a one-line error.
//! - Without it: a stub `Cuda` that can never be constructed.
//!
//! The tests below instantiate the whole forward pass for `Cuda`, which
//! proves that the model code depends on the `Backend` trait alone.

pub mod plan;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub use device::{driver_present, has_kernels, ptx_modules, Cuda, CudaKv, DevBuf, DevMat};

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::Cuda;

/// Whether this build has the CUDA backend, its kernels, and a driver to
/// run them (the GPU tests skip otherwise).
pub fn available() -> bool {
    #[cfg(feature = "cuda")]
    {
        has_kernels() && driver_present()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvCache;
    use crate::model::llama::{forward, RunState, StepIo};
    use crate::model::Weights;

    /// The forward pass compiles for a backend that is not the CPU: the
    /// model code reaches compute only through the `Backend` trait.
    #[allow(dead_code)]
    fn model_code_is_backend_generic(b: &Cuda, w: &Weights<'_, Cuda>, kv: &mut KvCache) {
        let mut s = RunState::new(b, w, 1);
        let _ = forward(b, w, &mut s, kv, &[0], 0, 1, StepIo::default());
    }

    #[test]
    fn cuda_without_a_gpu_is_a_one_line_error() {
        if available() {
            return; // a GPU machine: tests/cuda.rs covers it
        }
        let e = Cuda::new(0, 1).unwrap_err().to_string();
        assert!(e.contains("cuda:0"), "{e}");
        assert!(!e.contains('\n'));
        let e = crate::backend::Device::parse("cuda:1")
            .unwrap()
            .check()
            .unwrap_err()
            .to_string();
        assert!(e.contains("cuda:1"), "{e}");
        assert!(crate::backend::Device::parse("tpu").is_err());
        assert!(crate::backend::Device::Cpu.check().is_ok());
    }
}
