//! GGUF metadata values and typed access to them.
//!
//! Accessors on [`GgufFile`](super::GgufFile) (`u32`, `string`, …) name the
//! key in every error, so a caller never has to match on [`Value`] itself.
//! Integer accessors accept any integer type whose value fits, since
//! writers disagree on widths (`general.alignment` is u32 in the spec but
//! some tools write i32 or u64).

use super::GgufError;

/// A metadata value type id, as stored in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_u32(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes one value of this type takes at least (an empty string or
    /// array still has its u64 length).
    pub(crate) fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value. Arrays hold values of a single type.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(ValueType, Vec<Value>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
        }
    }

    /// A short description for error messages (`u32 7`, `array of 3 string`).
    pub fn describe(&self) -> String {
        match self {
            Value::String(s) if s.len() > 40 => format!("string of {} bytes", s.len()),
            Value::String(s) => format!("string {s:?}"),
            Value::Array(t, v) => format!("array of {} {t:?}", v.len()),
            other => format!("{other:?}"),
        }
    }

    /// The value as an integer, when it is one (any width or sign).
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(x) => x.into(),
            Value::I8(x) => x.into(),
            Value::U16(x) => x.into(),
            Value::I16(x) => x.into(),
            Value::U32(x) => x.into(),
            Value::I32(x) => x.into(),
            Value::U64(x) => x.into(),
            Value::I64(x) => x.into(),
            _ => return None,
        })
    }

    /// The value as a float, when it is a float or an integer. An f32 is
    /// read as its shortest decimal (`1e-5f32` → `1e-5`, not
    /// `9.99999974e-6`): converters write f32 from the decimal in the
    /// model's config, so this recovers the value the model was built with.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(x) => Some(x.to_string().parse().unwrap_or(x.into())),
            Value::F64(x) => Some(x),
            _ => self.as_i128().map(|x| x as f64),
        }
    }
}

/// Typed views of a value, each naming `key` when the type is wrong.
pub(crate) fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_string(),
        expected,
        found: v.describe(),
    }
}

pub(crate) fn to_u64(key: &str, v: &Value) -> Result<u64, GgufError> {
    v.as_i128()
        .and_then(|x| u64::try_from(x).ok())
        .ok_or_else(|| wrong(key, "a non-negative integer", v))
}

pub(crate) fn to_f64(key: &str, v: &Value) -> Result<f64, GgufError> {
    v.as_f64().ok_or_else(|| wrong(key, "a number", v))
}

pub(crate) fn to_str<'a>(key: &str, v: &'a Value) -> Result<&'a str, GgufError> {
    match v {
        Value::String(s) => Ok(s),
        other => Err(wrong(key, "a string", other)),
    }
}

pub(crate) fn to_bool(key: &str, v: &Value) -> Result<bool, GgufError> {
    match v {
        Value::Bool(b) => Ok(*b),
        other => Err(wrong(key, "a bool", other)),
    }
}

pub(crate) fn to_array<'a>(key: &str, v: &'a Value) -> Result<&'a [Value], GgufError> {
    match v {
        Value::Array(_, items) => Ok(items),
        other => Err(wrong(key, "an array", other)),
    }
}

pub(crate) fn to_str_array<'a>(key: &str, v: &'a Value) -> Result<Vec<&'a str>, GgufError> {
    to_array(key, v)?
        .iter()
        .map(|x| match x {
            Value::String(s) => Ok(s.as_str()),
            other => Err(wrong(key, "an array of strings", other)),
        })
        .collect()
}

pub(crate) fn to_f32_array(key: &str, v: &Value) -> Result<Vec<f32>, GgufError> {
    to_array(key, v)?
        .iter()
        .map(|x| {
            x.as_f64()
                .map(|f| f as f32)
                .ok_or_else(|| wrong(key, "an array of numbers", x))
        })
        .collect()
}

pub(crate) fn to_i64_array(key: &str, v: &Value) -> Result<Vec<i64>, GgufError> {
    to_array(key, v)?
        .iter()
        .map(|x| {
            x.as_i128()
                .and_then(|i| i64::try_from(i).ok())
                .ok_or_else(|| wrong(key, "an array of integers", x))
        })
        .collect()
}
