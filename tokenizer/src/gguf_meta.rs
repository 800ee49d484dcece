//! A GGUF metadata reader: the header and the key/value section of a `.gguf` file, nothing of
//! its tensors. What a process needs that serves no weights (the router: the tokenizer, the
//! context length, the architecture) without linking an inference library.
//!
//! ```text
//!  "GGUF" u32 version (2 or 3) u64 tensor_count u64 kv_count
//!  kv_count × { string key, u32 type, value }       string = u64 length + UTF-8 bytes
//!  types: 0 u8 1 i8 2 u16 3 i16 4 u32 5 i32 6 f32 7 bool 8 string 9 array 10 u64 11 i64 12 f64
//!  array = u32 element type, u64 count, count × value
//! ```
//! Invariants: every length and count is checked against the bytes the file still holds before
//! anything is allocated for it (a corrupt length is an error, never a huge allocation); nested
//! arrays are refused past a small depth; every refusal names the offset and what was wrong.

use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

/// One metadata value (the variants are GGUF's types).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// `string` (UTF-8).
    String(String),
    /// `array` (of one element type).
    Array(Vec<Value>),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn to_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
}

/// A GGUF file's metadata.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GgufMetadata {
    /// The format version (2 or 3).
    pub version: u32,
    /// Tensors the file declares (not read).
    pub tensor_count: u64,
    /// The key/value section.
    pub metadata: HashMap<String, Value>,
}

/// Why a file's metadata could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or read.
    #[error("reading {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The bytes are not GGUF metadata this reader accepts.
    #[error("{}: not valid GGUF metadata at byte {offset}: {what}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// Where reading stopped.
        offset: u64,
        /// What was wrong.
        what: String,
    },
}

/// Arrays inside arrays are refused below this depth.
const MAX_DEPTH: u32 = 4;

struct Reader<R> {
    inner: R,
    offset: u64,
    len: u64,
    path: PathBuf,
}

impl<R: Read> Reader<R> {
    fn malformed(&self, what: impl Into<String>) -> GgufError {
        GgufError::Malformed {
            path: self.path.clone(),
            offset: self.offset,
            what: what.into(),
        }
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut buf = [0u8; N];
        self.inner.read_exact(&mut buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                self.malformed("the file ends inside the metadata")
            } else {
                GgufError::Io {
                    path: self.path.clone(),
                    source: e,
                }
            }
        })?;
        self.offset += N as u64;
        Ok(buf)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// Checks that `count` items of at least `min_size` bytes each fit in what is left.
    fn fits(&self, count: u64, min_size: u64, what: &str) -> Result<(), GgufError> {
        let left = self.len.saturating_sub(self.offset);
        match count.checked_mul(min_size) {
            Some(need) if need <= left => Ok(()),
            _ => Err(self.malformed(format!(
                "{what} of {count} items does not fit in the {left} bytes left"
            ))),
        }
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        self.fits(len, 1, "a string")?;
        let mut buf = vec![0u8; len as usize];
        self.inner.read_exact(&mut buf).map_err(|e| GgufError::Io {
            path: self.path.clone(),
            source: e,
        })?;
        self.offset += len;
        String::from_utf8(buf).map_err(|_| self.malformed("a string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.bytes()?)),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.malformed(format!("bool byte {b}"))),
            },
            8 => Value::String(self.string()?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.malformed("arrays nested too deep"));
                }
                let elem = self.u32()?;
                let count = self.u64()?;
                let min_size = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(self.malformed(format!("unknown array element type {t}"))),
                };
                self.fits(count, min_size, "an array")?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            t => return Err(self.malformed(format!("unknown value type {t}"))),
        })
    }
}

impl GgufMetadata {
    /// Reads the metadata of the GGUF file at `path` (its tensors are not touched).
    pub fn read(path: &Path) -> Result<GgufMetadata, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        Self::read_from(BufReader::new(file), len, path)
    }

    /// Reads metadata from `reader`, which holds `len` bytes in all; `path` names it in errors.
    pub fn read_from(reader: impl Read, len: u64, path: &Path) -> Result<GgufMetadata, GgufError> {
        let mut r = Reader {
            inner: reader,
            offset: 0,
            len,
            path: path.to_path_buf(),
        };
        if &r.bytes::<4>()? != b"GGUF" {
            return Err(r.malformed("no GGUF magic"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(r.malformed(format!("version {version} (2 and 3 are read)")));
        }
        let tensor_count = r.u64()?;
        let kv_count = r.u64()?;
        // A key/value pair is at least a key length, a type and a one-byte value.
        r.fits(kv_count, 13, "the key/value section")?;
        let mut metadata = HashMap::with_capacity(kv_count as usize);
        for _ in 0..kv_count {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty, 0)?;
            metadata.insert(key, value);
        }
        Ok(GgufMetadata {
            version,
            tensor_count,
            metadata,
        })
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture")?.as_str()
    }

    /// `{architecture}.context_length`.
    pub fn context_length(&self) -> Option<u64> {
        let arch = self.architecture()?;
        self.get(&format!("{arch}.context_length"))?.to_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(s: &str) -> Vec<u8> {
        let mut b = (s.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(s.as_bytes());
        b
    }

    /// A GGUF v3 header with `kvs` (key, type, value bytes).
    fn file(kvs: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
        for (k, ty, v) in kvs {
            b.extend(string(k));
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(v);
        }
        b
    }

    fn read(bytes: &[u8]) -> Result<GgufMetadata, GgufError> {
        GgufMetadata::read_from(bytes, bytes.len() as u64, Path::new("t.gguf"))
    }

    #[test]
    fn every_value_type_and_the_context_length_read_back() {
        let mut arr = 8u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&2u64.to_le_bytes());
        arr.extend(string("a b"));
        arr.extend(string("c d"));
        let m = read(&file(&[
            ("general.architecture", 8, string("llama")),
            ("llama.context_length", 4, 8192u32.to_le_bytes().to_vec()),
            ("x.i8", 1, vec![0xff]),
            ("x.bool", 7, vec![1]),
            ("x.f64", 12, 1.5f64.to_le_bytes().to_vec()),
            ("x.i64", 11, (-3i64).to_le_bytes().to_vec()),
            ("tokenizer.ggml.merges", 9, arr),
        ]))
        .unwrap();
        assert_eq!(m.version, 3);
        assert_eq!(m.architecture(), Some("llama"));
        assert_eq!(m.context_length(), Some(8192));
        assert_eq!(m.get("x.i8"), Some(&Value::I8(-1)));
        assert_eq!(m.get("x.bool"), Some(&Value::Bool(true)));
        assert_eq!(m.get("x.f64"), Some(&Value::F64(1.5)));
        assert_eq!(m.get("x.i64"), Some(&Value::I64(-3)));
        assert_eq!(
            m.get("tokenizer.ggml.merges"),
            Some(&Value::Array(vec![
                Value::String("a b".into()),
                Value::String("c d".into())
            ]))
        );
    }

    #[test]
    fn corrupt_lengths_and_types_are_refused_without_allocating() {
        let good = file(&[("k", 8, string("v"))]);
        for cut in 0..good.len() {
            assert!(read(&good[..cut]).is_err(), "truncated at {cut}");
        }
        // A string length of 2^62: refused before any allocation.
        let mut huge = file(&[]);
        huge[16..24].copy_from_slice(&1u64.to_le_bytes());
        huge.extend_from_slice(&(1u64 << 62).to_le_bytes());
        huge.extend_from_slice(&[0; 16]);
        let err = read(&huge).unwrap_err().to_string();
        assert!(err.contains("a string of"), "{err}");
        // An array of 2^40 u64s.
        let mut arr = 10u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let err = read(&file(&[("a", 9, arr)])).unwrap_err().to_string();
        assert!(err.contains("does not fit"), "{err}");
        assert!(
            read(&file(&[("k", 13, vec![0; 8])]))
                .unwrap_err()
                .to_string()
                .contains("unknown value type 13")
        );
        assert!(read(&file(&[("k", 7, vec![2])])).is_err());
        let mut v1 = good.clone();
        v1[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(read(&v1).unwrap_err().to_string().contains("version 1"));
        assert!(
            read(b"GGUX\x03\0\0\0")
                .unwrap_err()
                .to_string()
                .contains("magic")
        );
    }
}
