//! A minimal GGUF header reader: the metadata key/values and the tensor table, never the weights.
//!
//! GGUF (versions 2 and 3) is `"GGUF"`, a u32 version, a u64 tensor count, a u64 metadata count,
//! the metadata (`key: string, type: u32, value`), then one `(name, n_dims: u32, dims: u64 ×
//! n_dims, ggml_type: u32, offset: u64)` per tensor; all little-endian, strings as u64 length +
//! UTF-8 bytes. Only scalar metadata is kept (arrays, such as the tokenizer's vocabulary, are
//! skipped with seeks), so reading a 100 MB file touches a few hundred KB.
//!
//! This exists because the planner must not need the engine's model loader. Once
//! `tandem_engine::ModelConfig::from_path` lands, [`super::model::read_model`] could call it
//! instead; the parameter count from the tensor table would still come from here.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use super::error::PlanError;

/// Scalar metadata values we keep (numbers as the widest type of their kind).
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// Any unsigned integer type.
    Uint(u64),
    /// Any signed integer type.
    Int(i64),
    /// f32 or f64.
    Float(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
}

impl GgufValue {
    /// The value as a non-negative integer, if it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::Uint(v) => Some(v),
            GgufValue::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
}

/// What the planner reads from a GGUF header.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Scalar metadata by key.
    pub metadata: HashMap<String, GgufValue>,
    /// Sum over tensors of the product of their dimensions.
    pub param_count: u64,
    /// Number of tensors in the table.
    pub tensor_count: u64,
}

/// Longest string (key, value or tensor name) accepted; real ones are far shorter.
const MAX_STRING_BYTES: u64 = 1 << 24;
/// Most dimensions a GGUF tensor may have.
const MAX_DIMS: u32 = 8;
/// Deepest nesting of arrays accepted (bounds the recursion on a hostile file).
const MAX_ARRAY_NESTING: u32 = 4;

/// Reads the header of the GGUF file at `path`.
pub fn read_header(path: &Path) -> Result<GgufHeader, PlanError> {
    let file = File::open(path).map_err(|source| PlanError::ModelRead {
        path: path.into(),
        source,
    })?;
    let mut r = Reader {
        inner: BufReader::new(file),
        offset: 0,
        path,
    };
    let magic = r.bytes::<4>()?;
    if &magic != b"GGUF" {
        return Err(r.malformed("no GGUF magic"));
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(r.malformed(format!("unsupported GGUF version {version} (2 and 3 are)")));
    }
    let tensor_count = r.u64()?;
    let kv_count = r.u64()?;
    let mut metadata = HashMap::new();
    for _ in 0..kv_count {
        let key = r.string()?;
        let ty = r.u32()?;
        if let Some(value) = r.value(ty)? {
            metadata.insert(key, value);
        }
    }
    let mut param_count: u64 = 0;
    for _ in 0..tensor_count {
        let _name = r.string()?;
        let n_dims = r.u32()?;
        if n_dims > MAX_DIMS {
            return Err(r.malformed(format!("tensor with {n_dims} dimensions")));
        }
        let mut elems: u64 = 1;
        for _ in 0..n_dims {
            let d = r.u64()?;
            elems = elems
                .checked_mul(d)
                .ok_or_else(|| r.malformed("tensor size overflows u64"))?;
        }
        let _ggml_type = r.u32()?;
        let _offset = r.u64()?;
        param_count = param_count
            .checked_add(elems)
            .ok_or_else(|| r.malformed("parameter count overflows u64"))?;
    }
    Ok(GgufHeader {
        version,
        metadata,
        param_count,
        tensor_count,
    })
}

struct Reader<'p> {
    inner: BufReader<File>,
    offset: u64,
    path: &'p Path,
}

impl Reader<'_> {
    fn malformed(&self, reason: impl Into<String>) -> PlanError {
        PlanError::GgufMalformed {
            path: self.path.into(),
            offset: self.offset,
            reason: reason.into(),
        }
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], PlanError> {
        let mut buf = [0u8; N];
        self.inner.read_exact(&mut buf).map_err(|e| self.io(e))?;
        self.offset += N as u64;
        Ok(buf)
    }

    fn io(&self, e: std::io::Error) -> PlanError {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            self.malformed("file ends inside the header")
        } else {
            PlanError::ModelRead {
                path: self.path.into(),
                source: e,
            }
        }
    }

    fn u32(&mut self) -> Result<u32, PlanError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, PlanError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    fn skip(&mut self, n: u64) -> Result<(), PlanError> {
        let n_i64 = i64::try_from(n).map_err(|_| self.malformed("skip too large"))?;
        self.inner.seek_relative(n_i64).map_err(|e| self.io(e))?;
        self.offset += n;
        Ok(())
    }

    fn string_len(&mut self) -> Result<u64, PlanError> {
        let len = self.u64()?;
        if len > MAX_STRING_BYTES {
            return Err(self.malformed(format!("string of {len} bytes")));
        }
        Ok(len)
    }

    fn string(&mut self) -> Result<String, PlanError> {
        let len = self.string_len()?;
        let mut buf = vec![0u8; len as usize];
        self.inner.read_exact(&mut buf).map_err(|e| self.io(e))?;
        self.offset += len;
        String::from_utf8(buf).map_err(|_| self.malformed("string is not UTF-8"))
    }

    /// Reads one value of GGUF type `ty`; arrays are skipped and give `None`.
    fn value(&mut self, ty: u32) -> Result<Option<GgufValue>, PlanError> {
        let v = match ty {
            0 => GgufValue::Uint(u64::from(self.bytes::<1>()?[0])),
            1 => GgufValue::Int(i64::from(self.bytes::<1>()?[0] as i8)),
            2 => GgufValue::Uint(u64::from(u16::from_le_bytes(self.bytes()?))),
            3 => GgufValue::Int(i64::from(i16::from_le_bytes(self.bytes()?))),
            4 => GgufValue::Uint(u64::from(self.u32()?)),
            5 => GgufValue::Int(i64::from(i32::from_le_bytes(self.bytes()?))),
            6 => GgufValue::Float(f64::from(f32::from_le_bytes(self.bytes()?))),
            7 => GgufValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => GgufValue::Str(self.string()?),
            9 => {
                let elem_ty = self.u32()?;
                let n = self.u64()?;
                self.skip_array(elem_ty, n, 0)?;
                return Ok(None);
            }
            10 => GgufValue::Uint(self.u64()?),
            11 => GgufValue::Int(i64::from_le_bytes(self.bytes()?)),
            12 => GgufValue::Float(f64::from_le_bytes(self.bytes()?)),
            other => return Err(self.malformed(format!("unknown metadata type {other}"))),
        };
        Ok(Some(v))
    }

    fn skip_array(&mut self, elem_ty: u32, n: u64, depth: u32) -> Result<(), PlanError> {
        if depth > MAX_ARRAY_NESTING {
            return Err(self.malformed("arrays nested too deeply"));
        }
        let fixed = match elem_ty {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        if let Some(size) = fixed {
            let bytes = n
                .checked_mul(size)
                .ok_or_else(|| self.malformed("array size overflows"))?;
            return self.skip(bytes);
        }
        for _ in 0..n {
            match elem_ty {
                8 => {
                    let len = self.string_len()?;
                    self.skip(len)?;
                }
                9 => {
                    let inner_ty = self.u32()?;
                    let inner_n = self.u64()?;
                    self.skip_array(inner_ty, inner_n, depth + 1)?;
                }
                other => return Err(self.malformed(format!("unknown array element type {other}"))),
            }
        }
        Ok(())
    }
}
