//! Cache writes: dtype conversion, Int8 scaling and requantization, fresh blocks, typed errors.

use crate::common;
use common::*;
use tandem_kernels::{KernelError, KvCacheMut, KvDtype, KvLayout, KvPart, read_kv, write_kv};

fn layout(dtype: KvDtype) -> KvLayout {
    KvLayout::new(2, 3, 20, 4, dtype, 0).unwrap()
}

fn read(
    l: &KvLayout,
    nb: usize,
    bytes: &[u8],
    layer: usize,
    slot: usize,
    head: usize,
    part: KvPart,
) -> Vec<f32> {
    let mut out = vec![0.0; l.head_dim];
    let c = tandem_kernels::KvCacheRef::new(l, nb, bytes);
    read_kv(
        &c,
        layer,
        slot / l.block_size_tokens,
        slot % l.block_size_tokens,
        head,
        part,
        &mut out,
    );
    out
}

#[test]
fn written_tokens_read_back_within_the_dtype_precision() {
    let mut rng = Rng::new(20);
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Int8] {
        let l = layout(dtype);
        let nb = 5;
        let mut bytes = vec![0u8; l.pool_bytes(nb)];
        let row = l.num_kv_heads * l.head_dim;
        // Whole blocks in order (offset 0 first), as a prefill writes them.
        let slots: Vec<usize> = (8..20).collect();
        let k = rng.vec(slots.len() * row, 2.0);
        let v = rng.vec(slots.len() * row, 2.0);
        let mut c = KvCacheMut::new(&l, nb, &mut bytes);
        write_kv(&mut c, 1, &k, &v, &slots).unwrap();
        let (rtol, atol) = match dtype {
            KvDtype::F32 => (0.0, 0.0),
            KvDtype::F16 => (1.0 / 2048.0, 0.0),
            KvDtype::Bf16 => (1.0 / 256.0, 0.0),
            // Half a step of the (f16-rounded-up) scale, ≤ 2/127 for |x| ≤ 2; whole blocks are
            // written in one call here, so keys are never requantized.
            KvDtype::Int8 => (0.0, 1.01 * 1.0 / 127.0),
        };
        for (t, &slot) in slots.iter().enumerate() {
            for h in 0..l.num_kv_heads {
                for (part, src) in [(KvPart::K, &k), (KvPart::V, &v)] {
                    let got = read(&l, nb, &bytes, 1, slot, h, part);
                    let want = &src[t * row + h * l.head_dim..t * row + (h + 1) * l.head_dim];
                    assert_close(
                        &got,
                        want,
                        atol,
                        rtol,
                        &format!("{dtype} slot {slot} head {h} {part:?}"),
                    );
                }
            }
        }
        // Layer 0 was not touched.
        assert!(
            read(&l, nb, &bytes, 0, 9, 0, KvPart::K)
                .iter()
                .all(|&x| x == 0.0),
            "{dtype}"
        );
    }
}

#[test]
fn int8_keys_requantize_per_channel_and_values_keep_their_own_scale() {
    let l = layout(KvDtype::Int8);
    let nb = 2;
    let mut bytes = vec![0u8; l.pool_bytes(nb)];
    let row = l.num_kv_heads * l.head_dim;
    let small = vec![0.5f32; row];
    // Only channel 0 of every head grows; the other channels keep their fine scale.
    let big: Vec<f32> = (0..row)
        .map(|i| if i % l.head_dim == 0 { 4.0 } else { 0.25 })
        .collect();
    let mut c = KvCacheMut::new(&l, nb, &mut bytes);
    write_kv(&mut c, 0, &small, &small, &[4]).unwrap(); // block 1, offset 0
    write_kv(&mut c, 0, &big, &big, &[5]).unwrap(); // same block: channel 0's key scale grows 8x
    let (k1, k2) = (
        read(&l, nb, &bytes, 0, 4, 2, KvPart::K),
        read(&l, nb, &bytes, 0, 5, 2, KvPart::K),
    );
    let (v1, v2) = (
        read(&l, nb, &bytes, 0, 4, 2, KvPart::V),
        read(&l, nb, &bytes, 0, 5, 2, KvPart::V),
    );
    // Channel 0 was requantized onto the 4/127 grid: within one step of it.
    assert!((k1[0] - 0.5).abs() <= 4.0 / 127.0, "{}", k1[0]);
    assert!((k2[0] - 4.0).abs() <= 0.5 * 4.0 / 127.0 * 1.01, "{}", k2[0]);
    // Other channels kept the 0.5/127 grid.
    assert!(
        k1[1..].iter().all(|&x| (x - 0.5).abs() <= 0.5 / 127.0),
        "{k1:?}"
    );
    assert!(
        k2[1..]
            .iter()
            .all(|&x| (x - 0.25).abs() <= 0.5 * 0.5 / 127.0 * 1.01),
        "{k2:?}"
    );
    // Values: each token on its own scale, never requantized.
    assert!(
        v1.iter()
            .all(|&x| (x - 0.5).abs() <= 0.5 * 0.5 / 127.0 * 1.01),
        "{v1:?}"
    );
    assert!(
        (v2[0] - 4.0).abs() <= 0.5 * 4.0 / 127.0 * 1.01
            && (v2[1] - 0.25).abs() <= 0.5 * 4.0 / 127.0 * 1.01,
        "{v2:?}"
    );
}

#[test]
fn writing_offset_zero_resets_a_recycled_blocks_scale() {
    let l = layout(KvDtype::Int8);
    let nb = 1;
    let mut bytes = vec![0u8; l.pool_bytes(nb)];
    let row = l.num_kv_heads * l.head_dim;
    let mut c = KvCacheMut::new(&l, nb, &mut bytes);
    // Previous owner: huge values.
    write_kv(&mut c, 0, &vec![100.0; row], &vec![100.0; row], &[0]).unwrap();
    // New owner starts at offset 0 with small values: must get a fine scale, not 100/127.
    write_kv(&mut c, 0, &vec![0.01; row], &vec![0.01; row], &[0]).unwrap();
    let got = read(&l, nb, &bytes, 0, 0, 1, KvPart::K);
    assert!(got.iter().all(|&x| (x - 0.01).abs() < 1e-4), "{got:?}");
}

#[test]
fn bad_slots_layers_and_shapes_are_typed_errors() {
    let l = layout(KvDtype::F16);
    let nb = 2;
    let mut bytes = vec![0u8; l.pool_bytes(nb)];
    let row = l.num_kv_heads * l.head_dim;
    let kv = vec![0.0; 2 * row];
    let mut c = KvCacheMut::new(&l, nb, &mut bytes);
    assert_eq!(
        write_kv(&mut c, 0, &kv, &kv, &[1, 8]).unwrap_err(),
        KernelError::SlotOutOfRange {
            op: "write_kv",
            token: 1,
            slot: 8,
            num_slots: 8
        }
    );
    assert!(matches!(
        write_kv(&mut c, 2, &kv, &kv, &[0, 1]),
        Err(KernelError::LayerOutOfRange {
            layer: 2,
            num_layers: 2,
            ..
        })
    ));
    assert!(matches!(
        write_kv(&mut c, 0, &kv[1..], &kv, &[0, 1]),
        Err(KernelError::ShapeMismatch { what, .. }) if what.starts_with('k')
    ));
    let mut short = vec![0u8; l.pool_bytes(nb) - 4];
    let mut c = KvCacheMut::new(&l, nb, &mut short);
    assert!(matches!(
        write_kv(&mut c, 0, &kv, &kv, &[0, 1]),
        Err(KernelError::ShapeMismatch { .. })
    ));
}
