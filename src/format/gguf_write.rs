//! GGUF v3 header writer: metadata and a tensor table, laid out the way
//! llama.cpp's writer does (tensors in table order, each at the next
//! multiple of the alignment). Used by [`super::synth`] to retype and
//! reshape a model's header; the data section is filled separately.

use crate::error::{Error, Result};
use crate::format::gguf::Value;
use crate::tensor::DType;

/// One tensor of a table to write.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub dtype: DType,
}

impl TensorSpec {
    /// Bytes of its data.
    pub fn n_bytes(&self) -> Result<u64> {
        let n0 = self.dims[0];
        let bl = self.dtype.block_len() as u64;
        if n0 % bl != 0 {
            return Err(Error::Other(format!(
                "tensor '{}': row length {n0} is not a multiple of {}'s block of {bl}",
                self.name, self.dtype
            )));
        }
        let rows: u64 = self.dims[1..].iter().product();
        Ok(n0 / bl * self.dtype.block_bytes() as u64 * rows)
    }
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::Str(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::Str(s) => put_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(a) => {
            // an empty array keeps no element type: written as u8
            out.extend_from_slice(&a.first().map_or(0, type_id).to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for x in a {
                put_value(out, x);
            }
        }
    }
}

/// The header bytes (padded to the alignment, so the data section starts
/// right after) and the data section's length.
pub fn header(
    metadata: &[(String, Value)],
    tensors: &[TensorSpec],
    alignment: u64,
) -> Result<(Vec<u8>, u64)> {
    if let Some((k, _)) = metadata.iter().find(
        |(_, v)| matches!(v, Value::Array(a) if a.iter().any(|x| type_id(x) != type_id(&a[0]))),
    ) {
        return Err(Error::Other(format!(
            "metadata '{k}': array of mixed types"
        )));
    }
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut out, k);
        out.extend_from_slice(&type_id(v).to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.dtype.ggml_id().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offset = (offset + t.n_bytes()?).div_ceil(alignment) * alignment;
    }
    let padded = (out.len() as u64).div_ceil(alignment) * alignment;
    out.resize(padded as usize, 0);
    Ok((out, offset))
}
