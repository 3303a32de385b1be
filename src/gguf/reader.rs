//! Parsing and validating a GGUF file.
//!
//! [`GgufFile::open`] memory-maps the file; [`GgufFile::from_bytes`] parses a
//! buffer (tests, tools). Both run the same checks, all before any tensor
//! byte is read:
//! - every length and count is bounded by the bytes left in the file (a
//!   count of 2⁶⁰ strings is rejected, not allocated), plus fixed limits on
//!   key, tensor and array-item counts, key length, nesting and dimensions,
//!   and nothing is allocated ahead for more than a few thousand entries;
//! - each tensor's dimensions are positive, at most four, and multiply
//!   without overflow to an element count divisible by its type's block size;
//! - each tensor's data is aligned to `general.alignment`, lies inside the
//!   file, and overlaps no other tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;

use super::value::{self, Value, ValueType};
use super::GgufError;

const MAGIC: &[u8; 4] = b"GGUF";
/// Longest metadata key or tensor name (the spec says 65535).
const MAX_NAME: u64 = 65_535;
/// Deepest nesting of arrays inside arrays.
const MAX_ARRAY_DEPTH: usize = 3;
/// GGML tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;
/// Largest single dimension accepted (2⁴⁰ elements; real ones are < 2³²).
const MAX_DIM: u64 = 1 << 40;
const DEFAULT_ALIGNMENT: u64 = 32;
/// Most metadata keys (real files have ~50).
const MAX_KV: u64 = 1 << 16;
/// Most tensors (real files have up to a few thousand).
const MAX_TENSORS: u64 = 1 << 20;
/// Most items of one metadata array. The largest real ones are vocabularies
/// and merge lists (~10⁵–10⁶); each parsed item takes 32 bytes, so this
/// bounds one array at 128 MiB whatever a corrupt length claims.
const MAX_ARRAY_LEN: u64 = 1 << 22;
/// Most entries allocated ahead of parsing them; beyond, vectors grow only
/// as entries actually parse.
const MAX_PREALLOC: u64 = 4096;

/// A GGML tensor type, as the file's type id names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType(pub u32);

impl GgmlType {
    /// The type's llama.cpp name, or `None` for an unknown id.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => return None,
        })
    }

    /// candle's block format for the types Tandem dequantises.
    pub fn candle(self) -> Option<GgmlDType> {
        Some(match self.0 {
            0 => GgmlDType::F32,
            1 => GgmlDType::F16,
            30 => GgmlDType::BF16,
            2 => GgmlDType::Q4_0,
            3 => GgmlDType::Q4_1,
            6 => GgmlDType::Q5_0,
            7 => GgmlDType::Q5_1,
            8 => GgmlDType::Q8_0,
            10 => GgmlDType::Q2K,
            11 => GgmlDType::Q3K,
            12 => GgmlDType::Q4K,
            13 => GgmlDType::Q5K,
            14 => GgmlDType::Q6K,
            _ => return None,
        })
    }
}

/// Where a tensor's data is and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the innermost (contiguous) dimension, the
    /// reverse of the row-major shape candle and Hugging Face use.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
    /// Bytes of data (checked to fit the file).
    pub size: u64,
}

impl TensorInfo {
    /// The row-major shape (`dims` reversed).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn elem_count(&self) -> u64 {
        self.dims.iter().product()
    }
}

enum Bytes {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mmap(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A parsed, validated GGUF file; tensor data stays in the map until asked for.
pub struct GgufFile {
    bytes: Bytes,
    /// Where the file came from (`<memory>` for a buffer), for messages.
    pub path: PathBuf,
    pub version: u32,
    /// Metadata in file order.
    metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Absolute offset of the data section.
    data_offset: u64,
    pub alignment: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; like every mmap-based loader we assume
        // nobody truncates or rewrites the file while it is loaded.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Bytes::Mmap(map), path.to_path_buf())
    }

    /// Parses a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Bytes::Owned(bytes), PathBuf::from("<memory>"))
    }

    fn parse(bytes: Bytes, path: PathBuf) -> Result<Self, GgufError> {
        let data = bytes.as_slice();
        let mut c = Cursor { data, pos: 0 };
        let magic = c.take(4, "magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic {
                found: magic.to_vec(),
            });
        }
        let version = c.u32("version")?;
        if version != 2 && version != 3 {
            let hint = if matches!(version.swap_bytes(), 2 | 3) {
                " (this file is big-endian)"
            } else if version == 1 {
                " (version 1 predates 64-bit counts; re-convert the model)"
            } else {
                ""
            };
            return Err(GgufError::UnsupportedVersion { version, hint });
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        // Each key/value takes at least 12 bytes, each tensor info 24.
        c.check_count("metadata count", n_kv, 12)?;
        c.check_count("tensor count", n_tensors, 24)?;
        check_limit("metadata count", n_kv, MAX_KV)?;
        check_limit("tensor count", n_tensors, MAX_TENSORS)?;

        let mut metadata = Vec::with_capacity(n_kv.min(MAX_PREALLOC) as usize);
        let mut index = HashMap::with_capacity(n_kv.min(MAX_PREALLOC) as usize);
        for _ in 0..n_kv {
            let key = c.string("metadata key", MAX_NAME)?;
            let type_at = c.pos as u64;
            let type_id = c.u32(&format!("type of metadata `{key}`"))?;
            let ty = ValueType::from_u32(type_id).ok_or_else(|| GgufError::BadValueType {
                key: key.clone(),
                type_id,
                offset: type_at,
            })?;
            let v = c.value(&key, ty, 0)?;
            if index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey(key));
            }
            metadata.push((key, v));
        }

        let alignment = match index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let a = value::to_u64("general.alignment", &metadata[i].1)?;
                if a == 0 || !a.is_power_of_two() || a > 1 << 20 {
                    return Err(GgufError::bad_meta(
                        "general.alignment",
                        format!("{a} is not a power of two up to 1 MiB"),
                    ));
                }
                a
            }
        };

        let mut tensors = Vec::with_capacity(n_tensors.min(MAX_PREALLOC) as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors.min(MAX_PREALLOC) as usize);
        for _ in 0..n_tensors {
            let t = c.tensor_info()?;
            if tensor_index.insert(t.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor(t.name));
            }
            tensors.push(t);
        }

        let data_offset = align_up(c.pos as u64, alignment);
        let len = data.len() as u64;
        if data_offset > len && !tensors.is_empty() {
            return Err(GgufError::Truncated {
                what: "padding before the tensor data".into(),
                offset: c.pos as u64,
                need: data_offset - c.pos as u64,
                len,
            });
        }
        check_tensor_data(&tensors, data_offset, len, alignment)?;

        Ok(Self {
            bytes,
            path,
            version,
            metadata,
            index,
            tensors,
            tensor_index,
            data_offset,
            alignment,
        })
    }

    /// Every metadata pair, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The value of `key`, or [`GgufError::MissingKey`].
    pub fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// A non-negative integer that fits `usize`.
    pub fn usize(&self, key: &str) -> Result<usize, GgufError> {
        let v = value::to_u64(key, self.require(key)?)?;
        usize::try_from(v).map_err(|_| GgufError::bad_meta(key, format!("{v} is too large")))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>, GgufError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.usize(key).map(Some)
    }

    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        value::to_f64(key, self.require(key)?)
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.get(key).map(|v| value::to_f64(key, v)).transpose()
    }

    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        value::to_str(key, self.require(key)?)
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key).map(|v| value::to_str(key, v)).transpose()
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key).map(|v| value::to_bool(key, v)).transpose()
    }

    pub fn str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        value::to_str_array(key, self.require(key)?)
    }

    pub fn f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        value::to_f32_array(key, self.require(key)?)
    }

    pub fn i64_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        value::to_i64_array(key, self.require(key)?)
    }

    /// Tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were checked at parse time).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + t.offset) as usize;
        &self.bytes.as_slice()[start..start + t.size as usize]
    }
}

fn check_limit(what: &str, value: u64, limit: u64) -> Result<(), GgufError> {
    if value > limit {
        return Err(GgufError::Limit {
            what: what.to_string(),
            value,
            limit,
        });
    }
    Ok(())
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a).saturating_mul(a)
}

/// Bytes of one tensor of `ty` and `dims`, after the per-tensor checks.
fn tensor_size(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
    let Some(type_name) = ty.name() else {
        return Err(GgufError::UnknownTensorType {
            tensor: name.to_string(),
            type_id: ty.0,
        });
    };
    let Some(dt) = ty.candle() else {
        return Err(GgufError::UnsupportedTensorType {
            tensor: name.to_string(),
            type_name,
        });
    };
    let mut elems: u64 = 1;
    for &d in dims {
        if d == 0 || d > MAX_DIM {
            return Err(GgufError::bad_tensor(
                name,
                format!("dimension {d} of {dims:?} is not between 1 and {MAX_DIM}"),
            ));
        }
        elems = elems
            .checked_mul(d)
            .ok_or_else(|| GgufError::bad_tensor(name, format!("dimensions {dims:?} overflow")))?;
    }
    let block = dt.block_size() as u64;
    if !dims[0].is_multiple_of(block) {
        return Err(GgufError::bad_tensor(
            name,
            format!(
                "innermost dimension {} is not a multiple of {type_name}'s block size {block}",
                dims[0]
            ),
        ));
    }
    (elems / block)
        .checked_mul(dt.type_size() as u64)
        .ok_or_else(|| GgufError::bad_tensor(name, format!("dimensions {dims:?} overflow")))
}

/// Alignment, bounds and overlap of every tensor's data.
fn check_tensor_data(
    tensors: &[TensorInfo],
    data_offset: u64,
    len: u64,
    alignment: u64,
) -> Result<(), GgufError> {
    let data_len = len.saturating_sub(data_offset);
    for t in tensors {
        if t.offset % alignment != 0 {
            return Err(GgufError::bad_tensor(
                &t.name,
                format!(
                    "data offset {} is not a multiple of the alignment {alignment}",
                    t.offset
                ),
            ));
        }
        let end = t.offset.checked_add(t.size);
        if end.is_none_or(|e| e > data_len) {
            return Err(GgufError::Truncated {
                what: format!("data of tensor `{}`", t.name),
                offset: data_offset.saturating_add(t.offset),
                need: t.size,
                len,
            });
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        if w[0].offset + w[0].size > w[1].offset {
            return Err(GgufError::bad_tensor(
                &w[1].name,
                format!("data overlaps tensor `{}`", w[0].name),
            ));
        }
    }
    Ok(())
}

/// A read position over the file with bounds-checked reads.
struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.data.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                need: n,
                len: self.data.len() as u64,
            });
        }
        let s = &self.data[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Rejects a count whose items (at least `min_size` bytes each) cannot
    /// fit in the rest of the file: a corrupt count is a truncated file,
    /// found before anything is allocated for it.
    fn check_count(&self, what: &str, count: u64, min_size: u64) -> Result<(), GgufError> {
        let need = count.saturating_mul(min_size);
        if need > self.remaining() {
            return Err(GgufError::Truncated {
                what: format!("{what} {count} (at least {min_size} bytes each)"),
                offset: self.pos as u64,
                need,
                len: self.data.len() as u64,
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str, max: u64) -> Result<String, GgufError> {
        let at = self.pos as u64;
        let n = self.u64(&format!("length of {what}"))?;
        if n > max {
            return Err(GgufError::Limit {
                what: format!("length of {what} at offset {at}"),
                value: n,
                limit: max,
            });
        }
        let bytes = self.take(n, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| GgufError::InvalidUtf8 {
                what: what.to_string(),
                offset: at + 8,
            })
    }

    fn value(&mut self, key: &str, ty: ValueType, depth: usize) -> Result<Value, GgufError> {
        let what = || format!("value of metadata `{key}`");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&what())?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(&what())?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what())?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what())?)),
            ValueType::U32 => Value::U32(self.u32(&what())?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what())?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what())?)),
            ValueType::U64 => Value::U64(self.u64(&what())?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what())?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what())?)),
            ValueType::Bool => match self.array::<1>(&what())?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(GgufError::bad_meta(
                        key,
                        format!("bool byte {b} at offset {}", self.pos - 1),
                    ))
                }
            },
            // Strings are bounded by the file itself (chat templates can be long).
            ValueType::String => Value::String(self.string(&what(), u64::MAX)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Limit {
                        what: format!("array nesting of metadata `{key}`"),
                        value: depth as u64 + 1,
                        limit: MAX_ARRAY_DEPTH as u64,
                    });
                }
                let at = self.pos as u64;
                let type_id = self.u32(&format!("array type of metadata `{key}`"))?;
                let item = ValueType::from_u32(type_id).ok_or(GgufError::BadValueType {
                    key: key.to_string(),
                    type_id,
                    offset: at,
                })?;
                let n = self.u64(&format!("array length of metadata `{key}`"))?;
                let what = format!("array length of metadata `{key}`");
                self.check_count(&what, n, item.min_size())?;
                check_limit(&what, n, MAX_ARRAY_LEN)?;
                let mut items = Vec::with_capacity(n.min(MAX_PREALLOC) as usize);
                for _ in 0..n {
                    items.push(self.value(key, item, depth + 1)?);
                }
                Value::Array(item, items)
            }
        })
    }

    fn tensor_info(&mut self) -> Result<TensorInfo, GgufError> {
        let name = self.string("tensor name", MAX_NAME)?;
        let n_dims = self.u32(&format!("dimension count of tensor `{name}`"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::bad_tensor(
                &name,
                format!("{n_dims} dimensions (expected 1 to {MAX_DIMS})"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64(&format!("dimensions of tensor `{name}`"))?);
        }
        let ggml_type = GgmlType(self.u32(&format!("type of tensor `{name}`"))?);
        let offset = self.u64(&format!("offset of tensor `{name}`"))?;
        let size = tensor_size(&name, &dims, ggml_type)?;
        Ok(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            size,
        })
    }
}
