//! Elementwise activations and helpers: SiLU-gating, residual add, argmax.
//!
//! `silu_mul` is `(g / (1 + exp(-g))) * u` with the crate's canonical polynomial `exp`;
//! `add_inplace` is one IEEE add per element; `argmax` is order-independent by definition
//! (first maximum wins, NaN never wins). All are per element, so trivially batch invariant.

use crate::Exec;
use crate::error::assert_len;
use crate::linear::SyncPtr;
use crate::norm::par_rows;
use crate::simd::{Isa, portable};

/// `gate_up`: `m` rows of `[gate (inter) | up (inter)]`; `out`: `m × inter` = `silu(gate) * up`.
pub fn silu_mul(gate_up: &[f32], m: usize, inter: usize, out: &mut [f32]) {
    silu_mul_on(&Exec::global(), gate_up, m, inter, out)
}

/// [`silu_mul`] on an explicit pool and ISA.
pub fn silu_mul_on(exec: &Exec<'_>, gate_up: &[f32], m: usize, inter: usize, out: &mut [f32]) {
    assert_len(
        "silu_mul",
        "gate_up (m * 2 * inter)",
        m * 2 * inter,
        gate_up.len(),
    );
    assert_len("silu_mul", "out (m * inter)", m * inter, out.len());
    let isa = exec.isa();
    let optr = SyncPtr(out.as_mut_ptr());
    par_rows(exec, m, inter, &|r| {
        for i in r {
            let g = &gate_up[i * 2 * inter..i * 2 * inter + inter];
            let u = &gate_up[i * 2 * inter + inter..(i + 1) * 2 * inter];
            // SAFETY: row `i` is written by exactly one task; `out` has `m * inter` floats.
            let o = unsafe { std::slice::from_raw_parts_mut(optr.get().add(i * inter), inter) };
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Exec` only holds supported ISAs.
                Isa::Avx512 => unsafe { crate::simd::avx512::silu_mul_row(g, u, o) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Isa::Avx2 => unsafe { crate::simd::avx2::silu_mul_row(g, u, o) },
                _ => portable::silu_mul_row(g, u, o),
            }
        }
    });
}

/// `a += b` elementwise. Panics if the lengths differ.
pub fn add_inplace(a: &mut [f32], b: &[f32]) {
    add_inplace_on(&Exec::global(), a, b)
}

/// [`add_inplace`] with an explicit ISA (always on the calling thread: it is memory-bound and
/// small in every model step).
pub fn add_inplace_on(exec: &Exec<'_>, a: &mut [f32], b: &[f32]) {
    assert_len("add_inplace", "b", a.len(), b.len());
    match exec.isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Exec` only holds supported ISAs.
        Isa::Avx512 => unsafe { crate::simd::avx512::add(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { crate::simd::avx2::add(a, b) },
        _ => portable::add(a, b),
    }
}

/// Index of the largest value; the lowest index wins ties; NaN never wins (0 if all are NaN
/// or `x` is empty).
pub fn argmax(x: &[f32]) -> usize {
    portable::argmax(x)
}
