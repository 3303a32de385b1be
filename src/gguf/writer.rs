//! A minimal GGUF v3 writer: builds a file image in memory from metadata
//! and raw tensor bytes. Tandem does not write models; this exists so tests
//! (and tools) can make small, exact GGUF files, valid or deliberately not.

use super::value::Value;

/// One tensor to write: GGML dimensions (innermost first), type id, bytes.
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub data: Vec<u8>,
}

/// Accumulates metadata and tensors, then [`to_bytes`](Self::to_bytes).
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<RawTensor>,
    pub alignment: u64,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self {
            version: 3,
            metadata: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
        }
    }

    pub fn kv(&mut self, key: &str, v: Value) -> &mut Self {
        self.metadata.push((key.to_string(), v));
        self
    }

    /// An f32 tensor of row-major `shape` (written with GGML's reversed dims).
    pub fn f32_tensor(&mut self, name: &str, shape: &[usize], data: &[f32]) -> &mut Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape of {name}"
        );
        self.tensors.push(RawTensor {
            name: name.to_string(),
            dims: shape.iter().rev().map(|&d| d as u64).collect(),
            type_id: 0,
            data: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        });
        self
    }

    pub fn raw_tensor(&mut self, t: RawTensor) -> &mut Self {
        self.tensors.push(t);
        self
    }

    /// The file image. Tensor data follows the infos, each aligned.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut out, v);
        }
        let a = self.alignment.max(1);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).div_ceil(a) * a;
        }
        let start = (out.len() as u64).div_ceil(a) * a;
        out.resize(start as usize, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize((start + off) as usize, 0);
            out.extend_from_slice(&t.data);
        }
        out
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
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(t, items) => {
            out.extend_from_slice(&(*t as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i);
            }
        }
    }
}
