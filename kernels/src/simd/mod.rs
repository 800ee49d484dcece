//! Instruction-set selection and the per-ISA inner loops.
//!
//! Every kernel has one *canonical* sequence of IEEE-754 operations per output element (see the
//! crate docs), and three implementations of it that produce the same bits:
//!
//! - [`portable`]: scalar Rust that emulates the 16-lane layout (`f32::mul_add` for fused
//!   multiply-add), runs anywhere; it is the executable definition of the canonical order.
//! - `avx512` (x86-64 with AVX-512F): 16 lanes per vector.
//! - `avx2` (x86-64 with AVX2 + FMA + F16C): each 16-lane group is two 8-lane vectors.
//!
//! The ISA is chosen once per process ([`active_isa`]): the best the CPU supports, unless the
//! environment variable `TANDEM_KERNELS` (see [`crate::env`]) or [`set_active_isa`] says otherwise.
//! The choice never depends on the batch size, so it cannot break batch invariance, and because
//! all three paths agree bit for bit, a prefill node and a decode node on different CPUs agree too.

use crate::KernelError;
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_gemm;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_quant;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_gemm;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_quant;
pub(crate) mod portable;

/// An implementation of the kernels' inner loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Scalar Rust, any CPU. Slow (fused multiply-add may be a library call), exact.
    Portable,
    /// x86-64 AVX2 + FMA + F16C, 8-lane vectors.
    Avx2,
    /// x86-64 AVX-512F, 16-lane vectors.
    Avx512,
}

impl Isa {
    /// Every ISA, slowest first.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// A stable lowercase name for flags, logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether this CPU can run this ISA (cached by the standard library's feature detection).
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f") && Isa::Avx2.is_supported(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The fastest ISA this CPU supports.
    pub fn best() -> Isa {
        [Isa::Avx512, Isa::Avx2]
            .into_iter()
            .find(|i| i.is_supported())
            .unwrap_or(Isa::Portable)
    }

    /// Every ISA this CPU supports, slowest first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    const fn tag(self) -> u8 {
        match self {
            Isa::Portable => 1,
            Isa::Avx2 => 2,
            Isa::Avx512 => 3,
        }
    }

    const fn from_tag(tag: u8) -> Option<Isa> {
        match tag {
            1 => Some(Isa::Portable),
            2 => Some(Isa::Avx2),
            3 => Some(Isa::Avx512),
            _ => None,
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Isa {
    type Err = KernelError;
    /// Parses `portable`, `avx2`, `avx512`, or `auto` (the best supported).
    fn from_str(s: &str) -> Result<Isa, KernelError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "portable" | "scalar" | "generic" => Ok(Isa::Portable),
            "avx2" => Ok(Isa::Avx2),
            "avx512" | "avx-512" | "avx512f" => Ok(Isa::Avx512),
            "auto" | "" => Ok(Isa::best()),
            _ => Err(KernelError::UnknownIsa(s.to_string())),
        }
    }
}

/// Hints the CPU to load `bytes` into L2 (one prefetch per cache line): used on the KV tiles
/// of the next blocks, because tiles (≤ 4 KiB) are scattered over the pool and each would
/// otherwise start with a full memory latency before the hardware streamer (which does not
/// cross page boundaries) picks it up. Measured ~15-20% faster decode attention over a 25 MB
/// pool than prefetching only each tile's first lines. No effect on results.
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..bytes.len()).step_by(64) {
        // SAFETY: prefetch never faults and the address is inside `bytes`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                bytes.as_ptr().add(line).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// V tiles of consecutive KV blocks for one accumulation call: `n` tokens of each tile, in
/// order; `scales[i * n + t]` is token `t` of tile `i`'s Int8 V scale (empty for float KV).
#[derive(Clone, Copy)]
pub(crate) struct VTiles<'a> {
    pub(crate) ptrs: &'a [*const u8],
    pub(crate) n: usize,
    pub(crate) scales: &'a [f32],
}

impl VTiles<'_> {
    /// Tokens in all tiles.
    pub(crate) fn tokens(&self) -> usize {
        self.ptrs.len() * self.n
    }
    /// The weight of token `t` of tile `i`: `e * scale` for Int8 (the token's value scale),
    /// `e` otherwise.
    #[inline]
    pub(crate) fn weight(&self, i: usize, t: usize, e: f32) -> f32 {
        if self.scales.is_empty() {
            e
        } else {
            e * self.scales[i * self.n + t]
        }
    }
}

/// 0 = not chosen yet; otherwise `Isa::tag`.
static ACTIVE: AtomicU8 = AtomicU8::new(0);

/// The ISA the plain kernel entry points use: chosen on first call from `TANDEM_KERNELS`
/// (portable | avx2 | avx512 | auto; an unsupported or unknown choice falls back to the best
/// supported one) and cached; [`set_active_isa`] replaces it.
pub fn active_isa() -> Isa {
    if let Some(isa) = Isa::from_tag(ACTIVE.load(Ordering::Relaxed)) {
        return isa;
    }
    let chosen = std::env::var(crate::env::TANDEM_KERNELS)
        .ok()
        .and_then(|v| v.parse::<Isa>().ok())
        .filter(|isa| isa.is_supported())
        .unwrap_or_else(Isa::best);
    // A racing first call computes the same answer; whichever store lands is fine.
    let _ = ACTIVE.compare_exchange(0, chosen.tag(), Ordering::Relaxed, Ordering::Relaxed);
    Isa::from_tag(ACTIVE.load(Ordering::Relaxed)).expect("ACTIVE holds a valid tag once set")
}

/// Makes every later plain kernel call use `isa` (e.g. `Isa::Portable` to force the fallback).
/// Fails if this CPU cannot run it. Results do not change (all ISAs agree bit for bit); speed does.
pub fn set_active_isa(isa: Isa) -> Result<(), KernelError> {
    if !isa.is_supported() {
        return Err(KernelError::IsaUnsupported(isa));
    }
    ACTIVE.store(isa.tag(), Ordering::Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isa_names_parse_and_portable_is_always_available() {
        assert_eq!("portable".parse::<Isa>().unwrap(), Isa::Portable);
        assert_eq!("AVX512".parse::<Isa>().unwrap(), Isa::Avx512);
        assert_eq!("auto".parse::<Isa>().unwrap(), Isa::best());
        assert!(matches!(
            "neon".parse::<Isa>(),
            Err(KernelError::UnknownIsa(_))
        ));
        assert!(Isa::Portable.is_supported());
        assert!(Isa::supported().contains(&Isa::best()));
        for isa in Isa::ALL {
            assert_eq!(isa.as_str().parse::<Isa>().unwrap(), isa);
        }
    }

    #[test]
    fn forcing_the_portable_path_switches_the_active_isa() {
        // Results do not depend on the ISA, so flipping it under other tests is harmless.
        let before = active_isa();
        set_active_isa(Isa::Portable).unwrap();
        assert_eq!(active_isa(), Isa::Portable);
        set_active_isa(before).unwrap();
        assert_eq!(active_isa(), before);
        for isa in Isa::ALL.into_iter().filter(|i| !i.is_supported()) {
            assert_eq!(set_active_isa(isa), Err(KernelError::IsaUnsupported(isa)));
        }
    }
}
