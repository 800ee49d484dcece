//! Weight matrices, stored once in the layout the `linear` kernels stream.
//!
//! A [`Weight`] is logically `[rows = out features][cols = in features]` (torch `Linear`
//! layout), but it is stored **panel-packed**: rows are grouped into panels of
//! [`PANEL_ROWS`] (32), and a panel stores its 32 rows column-interleaved:
//!
//! ```text
//! panel p = [k = 0: W[32p][0] W[32p+1][0] .. W[32p+31][0]] [k = 1: ...] .. [k = cols-1: ...]
//! ```
//!
//! so `linear` reads each weight exactly once, front to back, as 32-wide vectors of output
//! features, and every output element is one fused-multiply-add chain over `k` (see
//! [`crate::linear`]). The last panel is padded with zero rows. Buffers are 64-byte aligned.
//!
//! Block-quantized weights (`Q8_0`, `Q4_1`, `Q4_0`: GGUF's formats, kept as the file stores
//! them) use the same panels with a per-32-column record layout instead; see [`crate::quant`].
//!
//! Costs: packing is one pass over the matrix at load time; [`Weight::row_to_f32`] (embedding
//! lookup) gathers one row with stride 32 elements, `cols` reads.

use crate::KernelError;
use half::{bf16, f16};
use std::fmt;

/// Rows per packed panel (two 16-lane vectors).
pub const PANEL_ROWS: usize = 32;

/// Storage type of a weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightDtype {
    /// 4-byte IEEE float.
    F32,
    /// 2-byte IEEE half (widened to f32 exactly before use).
    F16,
    /// 2-byte bfloat16 (widened to f32 exactly before use).
    Bf16,
    /// GGUF Q8_0: blocks of 32 weights `q as f32 * d` (`q` i8, `d` f16), 8.5 bits a weight.
    Q8_0,
    /// GGUF Q4_1: blocks of 32 weights `q as f32 * d + m` (`q` 4 bits, `d`, `m` f16), 5 bits a
    /// weight.
    Q4_1,
    /// GGUF Q4_0: blocks of 32 weights `(q - 8) as f32 * d` (`q` 4 bits, `d` f16), 4.5 bits a
    /// weight.
    Q4_0,
}

impl WeightDtype {
    /// Bytes per stored element of a float dtype.
    ///
    /// # Panics
    /// For a quantized dtype, which has no whole number of bytes per element (see
    /// [`WeightDtype::bits_per_weight`]).
    pub const fn elem_bytes(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::F16 | WeightDtype::Bf16 => 2,
            WeightDtype::Q8_0 | WeightDtype::Q4_1 | WeightDtype::Q4_0 => {
                panic!("WeightDtype::elem_bytes: a quantized dtype has no per-element size")
            }
        }
    }

    /// Stored bits per weight, scales included (the GGUF file's own figure for quantized types).
    pub const fn bits_per_weight(self) -> f64 {
        match self {
            WeightDtype::F32 => 32.0,
            WeightDtype::F16 | WeightDtype::Bf16 => 16.0,
            WeightDtype::Q8_0 => 8.5,
            WeightDtype::Q4_1 => 5.0,
            WeightDtype::Q4_0 => 4.5,
        }
    }

    /// Block-quantized (decoded in registers by the `linear` kernels, columns in blocks of 32).
    pub const fn is_quantized(self) -> bool {
        matches!(
            self,
            WeightDtype::Q8_0 | WeightDtype::Q4_1 | WeightDtype::Q4_0
        )
    }

    /// A stable lowercase name, used in flags, metrics labels and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::F16 => "f16",
            WeightDtype::Bf16 => "bf16",
            WeightDtype::Q8_0 => "q8_0",
            WeightDtype::Q4_1 => "q4_1",
            WeightDtype::Q4_0 => "q4_0",
        }
    }
}

impl fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for WeightDtype {
    type Err = KernelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(WeightDtype::F32),
            "f16" | "float16" | "half" => Ok(WeightDtype::F16),
            "bf16" | "bfloat16" => Ok(WeightDtype::Bf16),
            "q8_0" => Ok(WeightDtype::Q8_0),
            "q4_1" => Ok(WeightDtype::Q4_1),
            "q4_0" => Ok(WeightDtype::Q4_0),
            _ => Err(KernelError::UnknownWeightDtype(s.to_string())),
        }
    }
}

/// One cache line; the unit of [`AlignedBytes`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A zero-initialised byte buffer whose start is 64-byte aligned.
#[derive(Clone)]
pub(crate) struct AlignedBytes {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedBytes {
    pub(crate) fn zeroed(len: usize) -> AlignedBytes {
        AlignedBytes {
            lines: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        // SAFETY: `lines` holds at least `len` initialised bytes, contiguous (repr(C) array).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// A dense weight matrix `[rows = out features][cols = in features]`, panel-packed (module docs).
#[derive(Clone)]
pub struct Weight {
    rows: usize,
    cols: usize,
    dtype: WeightDtype,
    data: AlignedBytes,
}

impl fmt::Debug for Weight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Weight")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl Weight {
    /// Packs a row-major f32 matrix, converting each element to `dtype` (round to nearest even).
    pub fn from_f32(
        rows: usize,
        cols: usize,
        data: Vec<f32>,
        dtype: WeightDtype,
    ) -> Result<Weight, KernelError> {
        Self::from_fn(rows, cols, dtype, data.len(), |r, k| data[r * cols + k])
    }

    /// Packs a row-major f16 matrix (no rounding for `F16`; exact widening for `F32`).
    pub fn from_f16(
        rows: usize,
        cols: usize,
        data: &[f16],
        dtype: WeightDtype,
    ) -> Result<Weight, KernelError> {
        Self::from_fn(rows, cols, dtype, data.len(), |r, k| {
            data[r * cols + k].to_f32()
        })
    }

    /// Packs a row-major bf16 matrix (no rounding for `Bf16`; exact widening for `F32`).
    pub fn from_bf16(
        rows: usize,
        cols: usize,
        data: &[bf16],
        dtype: WeightDtype,
    ) -> Result<Weight, KernelError> {
        Self::from_fn(rows, cols, dtype, data.len(), |r, k| {
            data[r * cols + k].to_f32()
        })
    }

    fn from_fn(
        rows: usize,
        cols: usize,
        dtype: WeightDtype,
        len: usize,
        get: impl Fn(usize, usize) -> f32,
    ) -> Result<Weight, KernelError> {
        let expected = rows.checked_mul(cols).ok_or(KernelError::ShapeMismatch {
            op: "Weight::from_f32",
            what: "rows * cols (overflows)",
            expected: usize::MAX,
            got: rows,
        })?;
        crate::error::check_len("Weight::from_f32", "data", expected, len)?;
        if dtype.is_quantized() {
            let blocks = crate::quant::quantize_rows(dtype, rows, cols, &get)?;
            return Weight::from_gguf_blocks(rows, cols, dtype, &blocks);
        }
        let panels = rows.div_ceil(PANEL_ROWS);
        let esz = dtype.elem_bytes();
        let mut buf = AlignedBytes::zeroed(panels * cols * PANEL_ROWS * esz);
        let bytes = buf.as_bytes_mut();
        for r in 0..rows {
            let (p, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
            for k in 0..cols {
                let at = ((p * cols + k) * PANEL_ROWS + lane) * esz;
                let v = get(r, k);
                match dtype {
                    WeightDtype::F32 => bytes[at..at + 4].copy_from_slice(&v.to_le_bytes()),
                    WeightDtype::F16 => {
                        bytes[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())
                    }
                    WeightDtype::Bf16 => bytes[at..at + 2]
                        .copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes()),
                    WeightDtype::Q8_0 | WeightDtype::Q4_1 | WeightDtype::Q4_0 => {
                        unreachable!("quantized above")
                    }
                }
            }
        }
        Ok(Weight {
            rows,
            cols,
            dtype,
            data: buf,
        })
    }

    /// Keeps GGUF quantized blocks as they are: `blocks` holds `rows` rows of `cols / 32`
    /// blocks each, row-major, in the file's encoding of `dtype` (`Q8_0`, `Q4_1` or `Q4_0`). Fails on a
    /// wrong length, `cols` not a multiple of 32, a float `dtype`, or a block whose scale or
    /// minimum is not finite ([`KernelError::BadQuantBlock`]: the file is corrupt).
    pub fn from_gguf_blocks(
        rows: usize,
        cols: usize,
        dtype: WeightDtype,
        blocks: &[u8],
    ) -> Result<Weight, KernelError> {
        let data = crate::quant::pack_gguf(dtype, rows, cols, blocks)?;
        Ok(Weight {
            rows,
            cols,
            dtype,
            data,
        })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Storage type.
    pub fn dtype(&self) -> WeightDtype {
        self.dtype
    }

    /// Bytes held, including the zero padding of the last panel.
    pub fn size_bytes(&self) -> usize {
        self.data.len
    }

    /// Number of packed panels (`ceil(rows / 32)`).
    pub fn panels(&self) -> usize {
        self.rows.div_ceil(PANEL_ROWS)
    }

    /// Bytes of one packed panel (`cols * 32 * elem_bytes`; quantized: `cols / 32` records).
    pub(crate) fn panel_bytes(&self) -> usize {
        if self.dtype.is_quantized() {
            crate::quant::panel_bytes(self.dtype, self.cols)
        } else {
            self.cols * PANEL_ROWS * self.dtype.elem_bytes()
        }
    }

    /// The packed bytes (module docs give the layout).
    pub(crate) fn packed(&self) -> &[u8] {
        self.data.as_bytes()
    }

    /// Element `(r, k)` widened to f32 (exact).
    pub fn get(&self, r: usize, k: usize) -> f32 {
        assert!(
            r < self.rows && k < self.cols,
            "Weight::get: ({r}, {k}) outside {}x{}",
            self.rows,
            self.cols
        );
        if self.dtype.is_quantized() {
            return crate::quant::load(self.dtype, self.packed(), self.cols, r, k);
        }
        let esz = self.dtype.elem_bytes();
        let at = (((r / PANEL_ROWS) * self.cols + k) * PANEL_ROWS + r % PANEL_ROWS) * esz;
        load_elem(self.dtype, self.packed(), at)
    }

    /// Row `r` widened to f32 into `out` (len cols). Used for embedding lookup.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        assert!(
            r < self.rows,
            "Weight::row_to_f32: row {r} outside {} rows",
            self.rows
        );
        crate::error::assert_len("Weight::row_to_f32", "out", self.cols, out.len());
        if self.dtype.is_quantized() {
            for (k, o) in out.iter_mut().enumerate() {
                *o = crate::quant::load(self.dtype, self.packed(), self.cols, r, k);
            }
            return;
        }
        let esz = self.dtype.elem_bytes();
        let base = (r / PANEL_ROWS) * self.cols * PANEL_ROWS + r % PANEL_ROWS;
        let bytes = self.packed();
        for (k, o) in out.iter_mut().enumerate() {
            *o = load_elem(self.dtype, bytes, (base + k * PANEL_ROWS) * esz);
        }
    }
}

/// Reads one little-endian element of `dtype` at byte offset `at`, widened to f32 (exact).
#[inline]
pub(crate) fn load_elem(dtype: WeightDtype, bytes: &[u8], at: usize) -> f32 {
    match dtype {
        WeightDtype::F32 => f32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")),
        WeightDtype::F16 => f16::from_bits(u16::from_le_bytes(
            bytes[at..at + 2].try_into().expect("2 bytes"),
        ))
        .to_f32(),
        WeightDtype::Bf16 => bf16::from_bits(u16::from_le_bytes(
            bytes[at..at + 2].try_into().expect("2 bytes"),
        ))
        .to_f32(),
        WeightDtype::Q8_0 | WeightDtype::Q4_1 | WeightDtype::Q4_0 => {
            unreachable!("load_elem: quantized weights are read by crate::quant")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_every_row_for_every_dtype() {
        let (rows, cols) = (37, 5);
        let data: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 7.0).collect();
        for dtype in [WeightDtype::F32, WeightDtype::F16, WeightDtype::Bf16] {
            let w = Weight::from_f32(rows, cols, data.clone(), dtype).unwrap();
            assert_eq!(w.panels(), 2);
            assert_eq!(w.size_bytes(), 2 * 32 * cols * dtype.elem_bytes());
            let mut row = vec![0.0; cols];
            for r in 0..rows {
                w.row_to_f32(r, &mut row);
                // Every value here is exactly representable in all three dtypes.
                assert_eq!(row, data[r * cols..(r + 1) * cols], "{dtype} row {r}");
                assert_eq!(w.get(r, cols - 1), data[r * cols + cols - 1]);
            }
        }
    }

    #[test]
    fn conversion_rounds_to_nearest_even() {
        let v = 1.0 + f32::EPSILON * 3.0; // not representable in f16/bf16
        for dtype in [WeightDtype::F16, WeightDtype::Bf16] {
            let w = Weight::from_f32(1, 1, vec![v], dtype).unwrap();
            let expect = match dtype {
                WeightDtype::F16 => f16::from_f32(v).to_f32(),
                _ => bf16::from_f32(v).to_f32(),
            };
            assert_eq!(w.get(0, 0).to_bits(), expect.to_bits());
        }
    }

    #[test]
    fn wrong_data_length_is_a_typed_shape_error() {
        let e = Weight::from_f32(3, 4, vec![0.0; 11], WeightDtype::F32).unwrap_err();
        assert_eq!(
            e,
            KernelError::ShapeMismatch {
                op: "Weight::from_f32",
                what: "data",
                expected: 12,
                got: 11
            }
        );
        assert!("f64".parse::<WeightDtype>().is_err());
        assert_eq!("BF16".parse::<WeightDtype>().unwrap(), WeightDtype::Bf16);
    }

    #[test]
    fn packed_buffer_is_cache_line_aligned() {
        let w = Weight::from_f32(5, 3, vec![1.0; 15], WeightDtype::F16).unwrap();
        assert_eq!(w.packed().as_ptr() as usize % 64, 0);
    }
}
