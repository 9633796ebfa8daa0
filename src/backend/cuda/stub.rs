//! The NVIDIA backend in a build without the `cuda` feature: [`Cuda`] is a
//! backend that can never be constructed (`Cuda::new` returns a one-line
//! error naming the missing feature), so `--device cuda` fails cleanly. Its
//! type still implements [`Backend`] (each op is unreachable by
//! construction: the struct holds an uninhabited value).

use crate::backend::cpu::pool::ThreadPool;
use crate::backend::{AttnStep, Backend, KvAccess, KvStore, KvType, Rope};
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::borrow::Cow;
use std::convert::Infallible;

/// An NVIDIA GPU (stub: this build has no CUDA support).
#[derive(Debug)]
pub struct Cuda {
    never: Infallible,
}

impl Cuda {
    /// Open GPU `ordinal`: always a one-line error in this build.
    pub fn new(ordinal: usize, _n_host_threads: usize) -> Result<Cuda> {
        Err(Error::arg(
            "--device",
            format!(
                "cuda:{ordinal}: this kvrun was built without the `cuda` feature (rebuild with `cargo build --release --features cuda` on a machine with the CUDA toolkit), so only --device cpu is available"
            ),
        ))
    }
}

impl Cuda {
    /// Another handle on the same GPU (never called: no `Cuda` exists).
    pub fn sibling(&self, _n_host_threads: usize) -> Cuda {
        match self.never {}
    }
    /// The device's read bandwidth (never called).
    pub fn read_bandwidth(&self) -> Result<f64> {
        match self.never {}
    }
}

/// Device memory (stub: never exists).
#[derive(Debug)]
pub struct DeviceBuf {
    never: Infallible,
}

impl Backend for Cuda {
    type Mat<'w> = DeviceBuf;
    type Vector = DeviceBuf;
    type Act = DeviceBuf;
    type Scratch = DeviceBuf;

    fn name(&self) -> String {
        match self.never {}
    }
    fn n_threads(&self) -> usize {
        match self.never {}
    }
    fn host_pool(&self) -> &ThreadPool {
        match self.never {}
    }
    fn matrix<'w>(&self, _: DType, _: usize, _: usize, _: Cow<'w, [u8]>) -> Result<DeviceBuf> {
        match self.never {}
    }
    fn vector(&self, _: Vec<f32>) -> Result<DeviceBuf> {
        match self.never {}
    }
    fn act(&self, _: usize) -> DeviceBuf {
        match self.never {}
    }
    fn scratch(&self) -> DeviceBuf {
        match self.never {}
    }
    fn kv_store(&self, _: KvType, _: usize, _: usize) -> Result<Box<dyn KvStore>> {
        match self.never {}
    }
    fn read(&self, a: &DeviceBuf, _: std::ops::Range<usize>, _: &mut Vec<f32>) {
        match a.never {}
    }
    fn host<'a>(&self, a: &'a DeviceBuf, _: std::ops::Range<usize>) -> Cow<'a, [f32]> {
        match a.never {}
    }
    fn mat_row(&self, m: &DeviceBuf, _: usize, _: &mut [f32]) {
        match m.never {}
    }
    fn mat_shape(&self, m: &DeviceBuf) -> (usize, usize) {
        match m.never {}
    }
    fn embed(&self, t: &DeviceBuf, _: &[u32], _: &mut DeviceBuf) {
        match t.never {}
    }
    fn rmsnorm(&self, x: &DeviceBuf, _: usize, _: &DeviceBuf, _: f32, _: usize, _: &mut DeviceBuf) {
        match x.never {}
    }
    fn matmul(
        &self,
        sc: &mut DeviceBuf,
        _: &[&DeviceBuf],
        _: &DeviceBuf,
        _: usize,
        _: &mut [&mut DeviceBuf],
    ) {
        match sc.never {}
    }
    fn matmul_host(
        &self,
        sc: &mut DeviceBuf,
        _: &DeviceBuf,
        _: &DeviceBuf,
        _: usize,
        _: &mut [f32],
    ) {
        match sc.never {}
    }
    fn add_bias(&self, x: &mut DeviceBuf, _: &DeviceBuf, _: usize) {
        match x.never {}
    }
    fn copy(&self, d: &mut DeviceBuf, _: &DeviceBuf, _: usize) {
        match d.never {}
    }
    fn rope(&self, _: &Rope, q: &mut DeviceBuf, _: &mut DeviceBuf, _: &AttnStep) {
        match q.never {}
    }
    fn kv_write(
        &self,
        _: &mut dyn KvAccess,
        _: usize,
        _: &[u32],
        k: &DeviceBuf,
        _: &DeviceBuf,
        _: usize,
        _: usize,
    ) {
        match k.never {}
    }
    fn begin_attention(&self, sc: &mut DeviceBuf, _: &dyn KvAccess, _: &AttnStep) {
        match sc.never {}
    }
    fn attention(
        &self,
        sc: &mut DeviceBuf,
        _: &dyn KvAccess,
        _: &AttnStep,
        _: usize,
        _: &Rope,
        _: &DeviceBuf,
        _: &DeviceBuf,
        _: &mut DeviceBuf,
    ) {
        match sc.never {}
    }
    fn end_attention(&self, sc: &mut DeviceBuf, _: usize, _: &mut [f32]) {
        match sc.never {}
    }
    fn add_rmsnorm(&self, x: &mut DeviceBuf, _: &mut DeviceBuf, _: &DeviceBuf, _: f32, _: usize) {
        match x.never {}
    }
    fn swiglu(&self, g: &mut DeviceBuf, _: &DeviceBuf, _: usize, _: usize) {
        match g.never {}
    }
    fn geglu(&self, g: &mut DeviceBuf, _: &DeviceBuf, _: usize, _: usize) {
        match g.never {}
    }
    fn rmsnorm_rows(&self, x: &mut DeviceBuf, _: &DeviceBuf, _: f32, _: usize) {
        match x.never {}
    }
    fn scale(&self, x: &mut DeviceBuf, _: f32, _: usize) {
        match x.never {}
    }
    fn gather_rows(&self, src: &DeviceBuf, _: &[u32], _: usize, _: &mut DeviceBuf) {
        match src.never {}
    }
    fn scatter_rows(&self, d: &mut DeviceBuf, _: &DeviceBuf, _: &[u32], _: &[f32], _: usize) {
        match d.never {}
    }
    fn sum_groups(&self, src: &DeviceBuf, _: usize, _: usize, _: usize, _: &mut DeviceBuf) {
        match src.never {}
    }
    fn add(&self, x: &mut DeviceBuf, _: &DeviceBuf, _: usize, _: usize) {
        match x.never {}
    }
}
