//! Block-quantized weights, GGUF's `Q8_0`, `Q4_1` and `Q4_0`, kept as the file stores them and
//! decoded in registers by `linear`.
//!
//! Values (GGUF's definitions, blocks of 32 consecutive columns of one row):
//! - `Q8_0`: `d: f16`, `q: [i8; 32]`; weight `q as f32 * d`.
//! - `Q4_1`: `d: f16`, `m: f16`, `q: [u4; 32]`; weight `q as f32 * d + m` (the multiply rounded,
//!   then the add rounded: no fused multiply-add).
//! - `Q4_0`: `d: f16`, `q: [u4; 32]`; weight `(q - 8) as f32 * d` (the subtraction in integers).
//!
//! Exactness: that is the very f32 value the loader's dequantisation (candle's `to_float`)
//! produces, and the kernels decode each weight to it and then run the canonical chain of
//! [`crate::linear`] (`acc = fma(x[k], w[k], acc)`, `k` ascending). So a quantized [`Weight`] gives
//! the same bits as the f32 `Weight` of its dequantised values, on every ISA, for every batch
//! size: the quantized path changes speed and memory, never a token.
//!
//! Packed layout: the panels of [`crate::Weight`] (32 rows each), every panel a sequence of one
//! record per 32-column block:
//!
//! ```text
//! Q8_0 record (1,088 B): d[32 rows] f16 | q[k = 0..32][32 rows] i8
//! Q4_1 record   (640 B): d[32 rows] f16 | m[32 rows] f16 | q[k = 0..32][16 B]
//!                        byte i of a k: row i in the low nibble, row i + 16 in the high one
//! Q4_0 record   (576 B): d[32 rows] f16 | q[k = 0..32][16 B] (nibbles as Q4_1)
//! ```
//!
//! Records are multiples of 64 bytes, so each starts a cache line; the bytes per weight equal the
//! file's (8.5, 5 and 4.5 bits). The last panel's padding rows are zero (`d = m = 0`: weight 0).

use crate::{KernelError, WeightDtype, weight::AlignedBytes, weight::PANEL_ROWS};
use half::f16;

/// The quantized dtypes as the SIMD decoders' const generic parameter (`decode::<Q>`).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) mod kind {
    use crate::WeightDtype;

    pub(crate) const Q8_0: u8 = 0;
    pub(crate) const Q4_1: u8 = 1;
    pub(crate) const Q4_0: u8 = 2;

    /// The constant of a quantized dtype.
    pub(crate) const fn of(d: WeightDtype) -> u8 {
        match d {
            WeightDtype::Q8_0 => Q8_0,
            WeightDtype::Q4_1 => Q4_1,
            _ => Q4_0,
        }
    }

    /// The dtype of constant `q`.
    pub(crate) const fn dtype(q: u8) -> WeightDtype {
        match q {
            Q8_0 => WeightDtype::Q8_0,
            Q4_1 => WeightDtype::Q4_1,
            _ => WeightDtype::Q4_0,
        }
    }
}

/// Columns per quantization block.
pub const QK: usize = 32;

/// Bytes of one GGUF block of `dtype`.
pub const fn gguf_block_bytes(dtype: WeightDtype) -> usize {
    match dtype {
        WeightDtype::Q8_0 => 2 + QK,
        WeightDtype::Q4_1 => 4 + QK / 2,
        WeightDtype::Q4_0 => 2 + QK / 2,
        _ => panic!("gguf_block_bytes: not a quantized dtype"),
    }
}

/// Bytes of one packed record (32 rows × 32 columns).
pub(crate) const fn record_bytes(dtype: WeightDtype) -> usize {
    match dtype {
        WeightDtype::Q8_0 => 2 * PANEL_ROWS + QK * PANEL_ROWS,
        WeightDtype::Q4_1 => 4 * PANEL_ROWS + QK * PANEL_ROWS / 2,
        WeightDtype::Q4_0 => 2 * PANEL_ROWS + QK * PANEL_ROWS / 2,
        _ => panic!("record_bytes: not a quantized dtype"),
    }
}

/// Offset of the quants within a record.
pub(crate) const fn quants_offset(dtype: WeightDtype) -> usize {
    match dtype {
        WeightDtype::Q4_1 => 4 * PANEL_ROWS,
        _ => 2 * PANEL_ROWS,
    }
}

/// Bytes of one packed panel of a `cols`-column matrix.
pub(crate) const fn panel_bytes(dtype: WeightDtype, cols: usize) -> usize {
    cols / QK * record_bytes(dtype)
}

fn f16_at(bytes: &[u8], at: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

fn check_cols(op: &'static str, cols: usize) -> Result<(), KernelError> {
    if cols % QK == 0 {
        Ok(())
    } else {
        Err(KernelError::NotDivisible {
            op,
            what: "columns by the quantization block (32)",
            numerator: cols,
            denominator: QK,
        })
    }
}

fn finite(v: f16, row: usize, block: usize, what: &'static str) -> Result<(), KernelError> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(KernelError::BadQuantBlock {
            row,
            block,
            what,
            value: v.to_f32().to_string(),
        })
    }
}

/// Packs GGUF blocks (`rows` rows of `cols / 32` blocks, row-major) into panel records.
pub(crate) fn pack_gguf(
    dtype: WeightDtype,
    rows: usize,
    cols: usize,
    blocks: &[u8],
) -> Result<AlignedBytes, KernelError> {
    const OP: &str = "Weight::from_gguf_blocks";
    if !dtype.is_quantized() {
        return Err(KernelError::UnknownWeightDtype(format!(
            "{dtype} (not a quantized dtype)"
        )));
    }
    check_cols(OP, cols)?;
    let (nb, gb, rec) = (cols / QK, gguf_block_bytes(dtype), record_bytes(dtype));
    crate::error::check_len(
        OP,
        "blocks (rows * cols / 32 * block bytes)",
        rows * nb * gb,
        blocks.len(),
    )?;
    let panels = rows.div_ceil(PANEL_ROWS);
    let mut buf = AlignedBytes::zeroed(panels * nb * rec);
    let out = buf.as_bytes_mut();
    let qo = quants_offset(dtype);
    for r in 0..rows {
        let (p, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
        for b in 0..nb {
            let src = &blocks[(r * nb + b) * gb..(r * nb + b + 1) * gb];
            let at = (p * nb + b) * rec;
            finite(f16_at(src, 0), r, b, "scale")?;
            out[at + 2 * lane..at + 2 * lane + 2].copy_from_slice(&src[0..2]);
            match dtype {
                WeightDtype::Q8_0 => {
                    for k in 0..QK {
                        out[at + qo + k * PANEL_ROWS + lane] = src[2 + k];
                    }
                }
                _ => {
                    let qs = if dtype == WeightDtype::Q4_1 {
                        finite(f16_at(src, 2), r, b, "min")?;
                        out[at + 64 + 2 * lane..at + 64 + 2 * lane + 2].copy_from_slice(&src[2..4]);
                        &src[4..]
                    } else {
                        &src[2..]
                    };
                    for k in 0..QK {
                        let q = if k < QK / 2 {
                            qs[k] & 0x0f
                        } else {
                            qs[k - QK / 2] >> 4
                        };
                        let byte = at + qo + k * (PANEL_ROWS / 2) + lane % (PANEL_ROWS / 2);
                        out[byte] |= if lane < PANEL_ROWS / 2 { q } else { q << 4 };
                    }
                }
            }
        }
    }
    Ok(buf)
}

/// Quantizes a row-major matrix (`get(r, k)`) into GGUF blocks of `dtype`, as llama.cpp's
/// reference quantizers do (`Q8_0`: `d = amax / 127`, `q = round(x / d)`; `Q4_1`:
/// `d = (max - min) / 15`, `m = min`, `q = min(15, trunc((x - m) / d + 0.5))`; `Q4_0`:
/// `d = x_amax / -8` for the value of largest magnitude, `q = min(15, trunc(x / d + 8.5))`).
pub(crate) fn quantize_rows(
    dtype: WeightDtype,
    rows: usize,
    cols: usize,
    get: &impl Fn(usize, usize) -> f32,
) -> Result<Vec<u8>, KernelError> {
    check_cols("Weight::from_f32", cols)?;
    let gb = gguf_block_bytes(dtype);
    let mut out = Vec::with_capacity(rows * cols / QK * gb);
    let mut x = [0f32; QK];
    for r in 0..rows {
        for b in 0..cols / QK {
            for (k, v) in x.iter_mut().enumerate() {
                *v = get(r, b * QK + k);
            }
            match dtype {
                WeightDtype::Q8_0 => {
                    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                    out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
                }
                WeightDtype::Q4_0 => {
                    let max = x
                        .iter()
                        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                    let d = max / -8.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                    let q = |v: f32| ((v * id + 8.5) as u8).min(15);
                    out.extend((0..QK / 2).map(|j| q(x[j]) | (q(x[j + QK / 2]) << 4)));
                }
                _ => {
                    let min = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                    let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                    let d = (max - min) / 15.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                    out.extend_from_slice(&f16::from_f32(min).to_bits().to_le_bytes());
                    let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
                    out.extend((0..QK / 2).map(|j| q(x[j]) | (q(x[j + QK / 2]) << 4)));
                }
            }
        }
    }
    Ok(out)
}

/// Weight `(r, k)` of a packed quantized matrix, decoded to its f32 value (exact, module docs).
#[inline]
pub(crate) fn load(dtype: WeightDtype, packed: &[u8], cols: usize, r: usize, k: usize) -> f32 {
    let nb = cols / QK;
    let (p, lane, b, kk) = (r / PANEL_ROWS, r % PANEL_ROWS, k / QK, k % QK);
    let rec = &packed[(p * nb + b) * record_bytes(dtype)..][..record_bytes(dtype)];
    let d = f16_at(rec, 2 * lane).to_f32();
    let qo = quants_offset(dtype);
    match dtype {
        WeightDtype::Q8_0 => rec[qo + kk * PANEL_ROWS + lane] as i8 as f32 * d,
        _ => {
            let byte = rec[qo + kk * (PANEL_ROWS / 2) + lane % (PANEL_ROWS / 2)];
            let q = if lane < PANEL_ROWS / 2 {
                byte & 0x0f
            } else {
                byte >> 4
            };
            if dtype == WeightDtype::Q4_0 {
                (q as i32 - 8) as f32 * d
            } else {
                q as f32 * d + f16_at(rec, 64 + 2 * lane).to_f32()
            }
        }
    }
}

/// Decodes panel `p` into `dst` in the f32 panel layout (`dst[k * 32 + lane]`, `cols * 32`
/// floats): what the portable path multiplies with (and the SIMD paths' reference).
pub(crate) fn dequant_panel(
    dtype: WeightDtype,
    packed: &[u8],
    cols: usize,
    p: usize,
    dst: &mut [f32],
) {
    crate::error::assert_len("quant::dequant_panel", "dst", cols * PANEL_ROWS, dst.len());
    let base = p * PANEL_ROWS;
    for k in 0..cols {
        for lane in 0..PANEL_ROWS {
            dst[k * PANEL_ROWS + lane] = load(dtype, packed, cols, base + lane, k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Weight;

    /// A GGUF Q4_1 block by hand: element j in the low nibble of byte j, j + 16 in the high one.
    fn q4_1_block(d: f32, m: f32, q: [u8; 32]) -> Vec<u8> {
        let mut b = f16::from_f32(d).to_bits().to_le_bytes().to_vec();
        b.extend_from_slice(&f16::from_f32(m).to_bits().to_le_bytes());
        b.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
        b
    }

    #[test]
    fn gguf_blocks_decode_to_the_dequantized_values() {
        // 33 rows (two panels, the second padded), 64 columns (two blocks a row).
        let (rows, cols) = (33, 64);
        let mut q4 = Vec::new();
        let mut q8 = Vec::new();
        let mut q40 = Vec::new();
        let mut expect40 = vec![0f32; rows * cols];
        let mut expect4 = vec![0f32; rows * cols];
        let mut expect8 = vec![0f32; rows * cols];
        for r in 0..rows {
            for b in 0..2 {
                let (d, m) = (0.01 * (r + 1) as f32, -0.5 + 0.1 * b as f32);
                let q: [u8; 32] = std::array::from_fn(|j| ((r * 7 + b * 3 + j) % 16) as u8);
                q4.extend(q4_1_block(d, m, q));
                // Q4_0: Q4_1's block without the minimum.
                q40.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                q40.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
                q8.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                for j in 0..32 {
                    let (dd, mm) = (f16::from_f32(d).to_f32(), f16::from_f32(m).to_f32());
                    expect4[r * cols + b * 32 + j] = q[j] as f32 * dd + mm;
                    expect40[r * cols + b * 32 + j] = (q[j] as i32 - 8) as f32 * dd;
                    let s = (q[j] as i8 - 8) * 9;
                    q8.push(s as u8);
                    expect8[r * cols + b * 32 + j] = s as f32 * dd;
                }
            }
        }
        for (dtype, blocks, expect) in [
            (WeightDtype::Q4_1, &q4, &expect4),
            (WeightDtype::Q8_0, &q8, &expect8),
            (WeightDtype::Q4_0, &q40, &expect40),
        ] {
            let w = Weight::from_gguf_blocks(rows, cols, dtype, blocks).unwrap();
            assert_eq!(w.size_bytes(), 2 * panel_bytes(dtype, cols));
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.row_to_f32(r, &mut row);
                assert_eq!(row, expect[r * cols..(r + 1) * cols], "{dtype} row {r}");
            }
        }
    }

    #[test]
    fn quantizing_f32_round_trips_within_half_a_step() {
        let (rows, cols) = (5, 64);
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        // Q4_0 maps the value of largest magnitude to -8 steps, so the other end clamps at +7:
        // up to a whole step (16 steps over the range, hence 8 here) off.
        for (dtype, steps) in [
            (WeightDtype::Q8_0, 254.0),
            (WeightDtype::Q4_1, 15.0),
            (WeightDtype::Q4_0, 8.0),
        ] {
            let w = Weight::from_f32(rows, cols, data.clone(), dtype).unwrap();
            for r in 0..rows {
                for b in 0..cols / QK {
                    let block = &data[r * cols + b * QK..r * cols + (b + 1) * QK];
                    let (lo, hi) = block
                        .iter()
                        .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
                    let range = if dtype != WeightDtype::Q4_1 {
                        2.0 * lo.abs().max(hi.abs())
                    } else {
                        hi - lo
                    };
                    for (k, v) in block.iter().enumerate() {
                        let got = w.get(r, b * QK + k);
                        // half a quantization step, plus the f16 rounding of the scale
                        assert!(
                            (got - v).abs() <= range / steps * 0.51 + 1e-3,
                            "{dtype} ({r},{k}): {got} vs {v}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bad_blocks_are_typed_errors() {
        let mut block = q4_1_block(0.5, 0.0, [1; 32]);
        assert!(matches!(
            Weight::from_gguf_blocks(1, 48, WeightDtype::Q4_1, &block),
            Err(KernelError::NotDivisible { numerator: 48, .. })
        ));
        assert!(matches!(
            Weight::from_gguf_blocks(2, 32, WeightDtype::Q4_1, &block),
            Err(KernelError::ShapeMismatch {
                expected: 40,
                got: 20,
                ..
            })
        ));
        block[2..4].copy_from_slice(&f16::NAN.to_bits().to_le_bytes());
        let e = Weight::from_gguf_blocks(1, 32, WeightDtype::Q4_1, &block).unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::BadQuantBlock {
                    row: 0,
                    block: 0,
                    what: "min",
                    ..
                }
            ),
            "{e}"
        );
        assert!(Weight::from_gguf_blocks(1, 32, WeightDtype::F16, &[0; 64]).is_err());
    }
}
