//! GGUF v2/v3 reader over a memory map: header, typed metadata, tensor table.
//!
//! Every read is bounds-checked against the mapped length; a corrupt length or
//! count becomes `Error::BadGguf` with the byte offset, never a panic or a
//! huge allocation. Tensor bytes are not copied: `tensor()` hands out slices of
//! the map. A header-only file parses fine (so `kvrun inspect` works on it);
//! `check_data()` is what reports missing tensor data.

use crate::error::{Error, Result};
use crate::format::mmap::Mapped;
use crate::tensor::{ggml_type_name, DType, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(Vec<Value>),
}

impl Value {
    /// Integer value of any integer (or bool) variant.
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            Value::U8(v) => v as i64,
            Value::I8(v) => v as i64,
            Value::U16(v) => v as i64,
            Value::I16(v) => v as i64,
            Value::U32(v) => v as i64,
            Value::I32(v) => v as i64,
            Value::U64(v) => i64::try_from(v).ok()?,
            Value::I64(v) => v,
            Value::Bool(v) => v as i64,
            _ => return None,
        })
    }
    /// Float value of any numeric variant.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    /// String contents.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// Array elements.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
    /// Short type name for messages and `inspect`.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::Str(_) => "str",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
            Value::Array(_) => "array",
        }
    }
}

/// One entry of the tensor table.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    /// Raw ggml type id (may be a type kvrun does not support).
    pub type_id: u32,
    /// Offset relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Byte size, if the type is supported and the shape is block-aligned.
    pub fn n_bytes(&self) -> Option<u64> {
        let t = DType::from_ggml_id(self.type_id)?;
        let n0 = *self.dims.first()?;
        if n0 % t.block_len() as u64 != 0 {
            return None;
        }
        let rows: u64 = self.dims.iter().skip(1).product();
        (n0 / t.block_len() as u64)
            .checked_mul(t.block_bytes() as u64)?
            .checked_mul(rows)
    }
}

/// A parsed GGUF file backed by a memory map.
#[derive(Debug)]
pub struct Gguf {
    pub path: PathBuf,
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Absolute offset of the tensor data section.
    pub data_offset: u64,
    pub alignment: u64,
    map: Mapped,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: impl Into<String>) -> Error {
        Error::BadGguf {
            path: self.path.to_owned(),
            offset: self.pos as u64,
            what: what.into(),
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(e) => {
                let s = &self.buf[self.pos..e];
                self.pos = e;
                Ok(s)
            }
            None => Err(self.err(format!(
                "unexpected end of file: need {n} bytes, {} left",
                self.buf.len() - self.pos
            ))),
        }
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    /// A count that must fit in the rest of the file at `min_elem` bytes each.
    fn count(&mut self, min_elem: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64()?;
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_elem as u64) > left {
            self.pos = at;
            return Err(self.err(format!(
                "{what} {n} exceeds the {left} bytes left in the file"
            )));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String> {
        let n = self.count(1, "string length")?;
        let at = self.pos;
        let s = self.take(n)?;
        match std::str::from_utf8(s) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => {
                self.pos = at;
                Err(self.err("string is not valid UTF-8"))
            }
        }
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.arr::<1>()?[0]),
            1 => Value::I8(self.arr::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.arr()?)),
            3 => Value::I16(i16::from_le_bytes(self.arr()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.arr()?)),
            6 => Value::F32(f32::from_le_bytes(self.arr()?)),
            7 => match self.arr::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("bool value {b} is neither 0 nor 1"))),
            },
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.err("arrays nested too deeply"));
                }
                let elem = self.u32()?;
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10 | 11 | 12 => 8,
                    9 => 12,
                    t => return Err(self.err(format!("unknown array element type {t}"))),
                };
                let n = self.count(min, "array length")?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(elem, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.arr()?)),
            12 => Value::F64(f64::from_le_bytes(self.arr()?)),
            t => return Err(self.err(format!("unknown metadata value type {t}"))),
        })
    }
}

impl Gguf {
    /// Open and parse a GGUF file.
    pub fn open(path: &Path) -> Result<Gguf> {
        Self::from_mapped(path, Mapped::open(path)?)
    }

    /// Parse GGUF bytes already mapped (`path` names them in messages).
    pub fn from_mapped(path: &Path, map: Mapped) -> Result<Gguf> {
        let parsed = Self::parse(path, map.bytes())?;
        let (version, metadata, tensors, data_offset, alignment) = parsed;
        let index = metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let tensor_index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Gguf {
            path: path.to_owned(),
            version,
            metadata,
            index,
            tensors,
            tensor_index,
            data_offset,
            alignment,
            map,
        })
    }

    #[allow(clippy::type_complexity)]
    fn parse(
        path: &Path,
        buf: &[u8],
    ) -> Result<(u32, Vec<(String, Value)>, Vec<TensorInfo>, u64, u64)> {
        let mut c = Cursor { buf, pos: 0, path };
        if buf.len() < 4 || &buf[..4] != MAGIC {
            return Err(c.err("not a GGUF file (bad magic)"));
        }
        c.pos = 4;
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            c.pos = 4;
            return Err(c.err(format!(
                "unsupported GGUF version {version} (kvrun reads v2 and v3)"
            )));
        }
        // A tensor info is at least 8 (name len) + 4 + 4 + 8 bytes; a KV at least 8 + 4 + 1.
        let n_tensors = c.count(24, "tensor count")?;
        let n_kv = c.count(13, "metadata count")?;
        let mut metadata = Vec::with_capacity(n_kv);
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            metadata.push((key, v));
        }
        let mut alignment = DEFAULT_ALIGNMENT;
        if let Some((_, v)) = metadata.iter().find(|(k, _)| k == "general.alignment") {
            match v.as_i64() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() => alignment = a as u64,
                _ => return Err(c.err(format!("general.alignment {v:?} is not a power of two"))),
            }
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let at = c.pos;
            let n_dims = c.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                c.pos = at;
                return Err(c.err(format!("tensor '{name}' has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64()?);
            }
            if dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .is_none()
            {
                c.pos = at;
                return Err(c.err(format!("tensor '{name}' shape {dims:?} overflows")));
            }
            let type_id = c.u32()?;
            let offset = c.u64()?;
            if offset % alignment != 0 {
                return Err(c.err(format!(
                    "tensor '{name}' offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                type_id,
                offset,
            });
        }
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        Ok((version, metadata, tensors, data_offset, alignment))
    }

    /// The mapped file bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.bytes()
    }

    /// Metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn meta_err(&self, key: &str, what: impl Into<String>) -> Error {
        Error::BadMetadata {
            path: self.path.clone(),
            key: key.to_owned(),
            what: what.into(),
        }
    }

    /// Required string value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.get(key) {
            None => Err(self.meta_err(key, "missing")),
            Some(v) => v.as_str().ok_or_else(|| {
                self.meta_err(key, format!("expected a string, found {}", v.type_name()))
            }),
        }
    }

    /// Required non-negative integer value.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        match self.get(key) {
            None => Err(self.meta_err(key, "missing")),
            Some(v) => match v.as_i64() {
                Some(x) if x >= 0 => Ok(x as usize),
                _ => {
                    Err(self.meta_err(key, format!("expected a non-negative integer, found {v:?}")))
                }
            },
        }
    }

    /// Optional float value.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) => Ok(Some(x as f32)),
                None => {
                    Err(self.meta_err(key, format!("expected a number, found {}", v.type_name())))
                }
            },
        }
    }

    /// Tensor info by name.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Check that every tensor's type is supported and its bytes lie inside the file.
    pub fn check_data(&self) -> Result<()> {
        for t in &self.tensors {
            self.tensor_range(t)?;
        }
        Ok(())
    }

    fn tensor_range(&self, t: &TensorInfo) -> Result<(DType, usize, usize)> {
        let Some(dtype) = DType::from_ggml_id(t.type_id) else {
            return Err(Error::UnsupportedTensorType {
                path: self.path.clone(),
                tensor: t.name.clone(),
                ty: ggml_type_name(t.type_id),
            });
        };
        let Some(n) = t.n_bytes() else {
            let what = if !t.dims[0].is_multiple_of(dtype.block_len() as u64) {
                format!(
                    "tensor '{}' row length {} is not a multiple of the {} block size {}",
                    t.name,
                    t.dims[0],
                    dtype,
                    dtype.block_len()
                )
            } else {
                format!(
                    "tensor '{}' of shape {:?} and type {} is too large",
                    t.name, t.dims, dtype
                )
            };
            return Err(Error::BadGguf {
                path: self.path.clone(),
                offset: self.data_offset.saturating_add(t.offset),
                what,
            });
        };
        let start = self.data_offset.saturating_add(t.offset);
        let end = start.saturating_add(n);
        let file_len = self.bytes().len() as u64;
        if end > file_len {
            return Err(Error::TensorDataMissing {
                path: self.path.clone(),
                tensor: t.name.clone(),
                start,
                end,
                file_len,
            });
        }
        Ok((dtype, start as usize, end as usize))
    }

    /// A zero-copy view of a tensor's bytes.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let t = self.info(name).ok_or_else(|| Error::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_owned(),
        })?;
        let (dtype, start, end) = self.tensor_range(t)?;
        Ok(TensorView {
            dtype,
            dims: &t.dims,
            bytes: &self.bytes()[start..end],
        })
    }
}

/// Parse a GGUF image held in memory (used by the fuzz target and tests).
pub fn parse_bytes(buf: &[u8]) -> Result<usize> {
    let (_, md, t, _, _) = Gguf::parse(Path::new("<memory>"), buf)?;
    Ok(md.len() + t.len())
}
