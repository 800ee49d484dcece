//! Rotary position embeddings, rotate-half ("NeoX" / Hugging Face) convention.
//!
//! Pairs are `(i, i + head_dim/2)` with `inv_freq_i = theta^(-2i/head_dim)`. The table holds
//! `cos` and `sin` of `pos * inv_freq_i`, computed in f64 and stored as f32, for every position
//! below `max_positions`. Per element: `a*cos - b*sin`, `b*cos + a*sin`, each product rounded
//! (unfused), which is also what an unfused f32 framework computes from the same table.
//!
//! Cost: table `2 * max_positions * head_dim/2` floats; applying it is 6 flops per pair.

use crate::Exec;
use crate::error::assert_len;
use crate::linear::SyncPtr;
use crate::norm::par_rows;
use crate::simd::{Isa, portable};

/// Precomputed RoPE cos/sin for positions `0..max_positions`.
#[derive(Clone, Debug)]
pub struct RopeTable {
    head_dim: usize,
    max_positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Builds the table (angles in f64). Panics if `head_dim` is odd or zero.
    pub fn new(head_dim: usize, max_positions: usize, theta: f64) -> RopeTable {
        assert!(
            head_dim > 0 && head_dim.is_multiple_of(2),
            "RopeTable: head_dim {head_dim} must be even and > 0"
        );
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for pos in 0..max_positions {
            for i in 0..half {
                let inv_freq = theta.powf(-((2 * i) as f64) / head_dim as f64);
                let angle = pos as f64 * inv_freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        RopeTable {
            head_dim,
            max_positions,
            cos,
            sin,
        }
    }

    /// Positions covered.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Head dimension the table was built for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The whole `(cos, sin)` tables, row-major by position (`max_positions × head_dim/2`
    /// each): what a device copy of the table uploads.
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// `(cos, sin)` rows for `pos`, each `head_dim / 2` long.
    pub fn row(&self, pos: usize) -> (&[f32], &[f32]) {
        assert!(
            pos < self.max_positions,
            "RopeTable: position {pos} >= max_positions {}",
            self.max_positions
        );
        let half = self.head_dim / 2;
        (
            &self.cos[pos * half..(pos + 1) * half],
            &self.sin[pos * half..(pos + 1) * half],
        )
    }
}

/// `x`: `[T × n_heads × head_dim]`; row `t` rotated by `positions[t]`, in place. Panics on a
/// shape mismatch or a position outside the table.
pub fn rope(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    positions: &[usize],
    table: &RopeTable,
) {
    rope_on(&Exec::global(), x, n_heads, head_dim, positions, table)
}

/// [`rope`] on an explicit pool and ISA.
pub fn rope_on(
    exec: &Exec<'_>,
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    positions: &[usize],
    table: &RopeTable,
) {
    assert_len("rope", "head_dim (table)", table.head_dim, head_dim);
    let row = n_heads * head_dim;
    assert_len(
        "rope",
        "x (T * n_heads * head_dim)",
        positions.len() * row,
        x.len(),
    );
    if let Some(&bad) = positions.iter().find(|&&p| p >= table.max_positions) {
        panic!(
            "rope: position {bad} >= table max_positions {}",
            table.max_positions
        );
    }
    let isa = exec.isa();
    let xptr = SyncPtr(x.as_mut_ptr());
    par_rows(exec, positions.len(), row, &|r| {
        for t in r {
            let (cos, sin) = table.row(positions[t]);
            for h in 0..n_heads {
                // SAFETY: each (t, h) head is touched by exactly one task; in bounds by the check.
                let xh = unsafe {
                    std::slice::from_raw_parts_mut(xptr.get().add(t * row + h * head_dim), head_dim)
                };
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `Exec` only holds supported ISAs.
                    Isa::Avx512 => unsafe { crate::simd::avx512::rope_head(xh, cos, sin) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    Isa::Avx2 => unsafe { crate::simd::avx2::rope_head(xh, cos, sin) },
                    _ => portable::rope_head(xh, cos, sin),
                }
            }
        }
    });
}
