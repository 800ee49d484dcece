//! ISA dispatch for the attention inner loops (scores, softmax weights, V accumulation).

use crate::simd::{Isa, portable};
use tandem_kv_layout::KvDtype;

/// # Safety
/// `tile` holds `n` tokens of `q.len()` elements; `s` has room for `n`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores(
    isa: Isa,
    dt: KvDtype,
    q: &[f32],
    tile: &[u8],
    n: usize,
    ks: Option<f32>,
    mul: f32,
    s: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    use crate::simd::{
        avx512::DT_I8,
        avx512_gemm::{DT_BF16, DT_F16, DT_F32},
    };
    #[cfg(target_arch = "x86_64")]
    macro_rules! go {
        ($m:ident) => {
            unsafe {
                match dt {
                    KvDtype::F32 => {
                        crate::simd::$m::scores::<DT_F32>(q, tile.as_ptr(), n, ks, mul, s)
                    }
                    KvDtype::F16 => {
                        crate::simd::$m::scores::<DT_F16>(q, tile.as_ptr(), n, ks, mul, s)
                    }
                    KvDtype::Bf16 => {
                        crate::simd::$m::scores::<DT_BF16>(q, tile.as_ptr(), n, ks, mul, s)
                    }
                    KvDtype::Int8 => {
                        crate::simd::$m::scores::<DT_I8>(q, tile.as_ptr(), n, ks, mul, s)
                    }
                }
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => go!(avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => go!(avx2),
        _ => portable::scores(q, tile, kv_loader(dt), n, ks, mul, s),
    }
}

fn kv_loader(dt: KvDtype) -> portable::KvLoad {
    match dt {
        KvDtype::F32 => portable::kv_load_f32,
        KvDtype::F16 => portable::kv_load_f16,
        KvDtype::Bf16 => portable::kv_load_bf16,
        KvDtype::Int8 => portable::kv_load_i8,
    }
}

pub(super) fn softmax_weights(isa: Isa, s: &mut [f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Exec` only holds supported ISAs.
        Isa::Avx512 => unsafe { crate::simd::avx512::softmax_weights(s) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { crate::simd::avx2::softmax_weights(s) },
        _ => portable::softmax_weights(s),
    }
}

/// Most tiles one [`accumulate_v`] call takes.
pub(super) const MAX_TILES: usize = 16;

/// # Safety
/// Each of `tiles` (≤ `MAX_TILES`) holds `n` tokens of `hd` elements; each `e` row has
/// `tiles.len() * n` weights; each `acc` row points at `hd` rounded up to 16 floats, whose `dims`
/// are not accessed elsewhere during the call; `dims` starts at a multiple of 16 and ends at one
/// or at `hd`; `scales` is empty or one Int8 V scale per token (`tiles.len() * n`). `e.len() <= 4`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn accumulate_v(
    isa: Isa,
    dt: KvDtype,
    e: &[&[f32]],
    tiles: &[&[u8]],
    n: usize,
    scales: &[f32],
    hd: usize,
    dims: std::ops::Range<usize>,
    acc: &[*mut f32],
) {
    #[cfg(target_arch = "x86_64")]
    use crate::simd::{
        avx512::DT_I8,
        avx512_gemm::{DT_BF16, DT_F16, DT_F32},
    };
    assert!(
        tiles.len() <= MAX_TILES,
        "accumulate_v: {} tiles",
        tiles.len()
    );
    let mut ptrs = [std::ptr::null::<u8>(); MAX_TILES];
    for (p, t) in ptrs.iter_mut().zip(tiles) {
        *p = t.as_ptr();
    }
    let vt = crate::simd::VTiles {
        ptrs: &ptrs[..tiles.len()],
        n,
        scales,
    };
    #[cfg(target_arch = "x86_64")]
    macro_rules! go_g {
        ($m:ident, $g:literal) => {{
            let er: [&[f32]; $g] = std::array::from_fn(|i| e[i]);
            let ar: [*mut f32; $g] = std::array::from_fn(|i| acc[i]);
            unsafe {
                match dt {
                    KvDtype::F32 => {
                        crate::simd::$m::accumulate_v::<DT_F32, $g>(er, vt, hd, dims.clone(), ar)
                    }
                    KvDtype::F16 => {
                        crate::simd::$m::accumulate_v::<DT_F16, $g>(er, vt, hd, dims.clone(), ar)
                    }
                    KvDtype::Bf16 => {
                        crate::simd::$m::accumulate_v::<DT_BF16, $g>(er, vt, hd, dims.clone(), ar)
                    }
                    KvDtype::Int8 => {
                        crate::simd::$m::accumulate_v::<DT_I8, $g>(er, vt, hd, dims.clone(), ar)
                    }
                }
            }
        }};
    }
    #[cfg(target_arch = "x86_64")]
    macro_rules! go {
        ($m:ident) => {
            match e.len() {
                1 => go_g!($m, 1),
                2 => go_g!($m, 2),
                3 => go_g!($m, 3),
                _ => go_g!($m, 4),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => go!(avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => go!(avx2),
        _ => {
            let _ = vt;
            // SAFETY: per the contract the `dims` of each row are ours alone during the call.
            let mut rows: Vec<&mut [f32]> = acc
                .iter()
                .map(|&p| unsafe { std::slice::from_raw_parts_mut(p.add(dims.start), dims.len()) })
                .collect();
            portable::accumulate_v(e, tiles, n, scales, kv_loader(dt), hd, dims, &mut rows)
        }
    }
}
