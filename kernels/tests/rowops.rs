//! RMSNorm, RoPE, SiLU-gating, add and argmax against the oracles, bitwise across ISAs,
//! thread counts and batch sizes.

use crate::common;
use common::*;
use tandem_kernels::{
    RopeTable, add_inplace_on, argmax, reference, rms_norm_on, rope_on, silu_mul_on,
};

#[test]
fn rms_norm_matches_reference_and_is_bitwise_identical_everywhere() {
    let mut rng = Rng::new(10);
    for n in [1usize, 7, 16, 17, 64, 576, 1000] {
        let w = rng.vec(n, 2.0);
        for rows in [1usize, 3, 64] {
            let x = rng.vec(rows * n, 3.0);
            let mut want = vec![0.0; rows * n];
            reference::rms_norm(&x, &w, 1e-5, &mut want);
            let mut first: Option<Vec<f32>> = None;
            for exec in all_execs() {
                let mut got = vec![f32::NAN; rows * n];
                rms_norm_on(&exec, &x, &w, 1e-5, &mut got);
                assert_close(
                    &got,
                    &want,
                    1e-6,
                    2e-6,
                    &format!("n={n} rows={rows} {}", exec.isa()),
                );
                match &first {
                    None => first = Some(got),
                    Some(f) => {
                        assert_bits_eq(&got, f, &format!("n={n} rows={rows} {}", exec.isa()))
                    }
                }
            }
            // A row alone equals the same row in the batch.
            let mut one = vec![0.0; n];
            rms_norm_on(&fast(), &x[(rows - 1) * n..], &w, 1e-5, &mut one);
            assert_bits_eq(
                &one,
                &first.unwrap()[(rows - 1) * n..],
                "row alone vs batch",
            );
        }
    }
}

#[test]
fn rope_matches_f64_angles_and_is_bitwise_identical_everywhere() {
    let mut rng = Rng::new(11);
    for (hd, heads) in [(2usize, 1usize), (18, 2), (64, 9), (128, 3)] {
        let table = RopeTable::new(hd, 4096, 10_000.0);
        assert_eq!(table.max_positions(), 4096);
        let positions: Vec<usize> = vec![0, 1, 2, 511, 4095, 17];
        let x = rng.vec(positions.len() * heads * hd, 1.0);
        let mut want = x.clone();
        reference::rope(&mut want, heads, hd, &positions, 10_000.0);
        let mut first: Option<Vec<f32>> = None;
        for exec in all_execs() {
            let mut got = x.clone();
            rope_on(&exec, &mut got, heads, hd, &positions, &table);
            assert_close(&got, &want, 1e-6, 1e-6, &format!("hd={hd} {}", exec.isa()));
            match &first {
                None => first = Some(got),
                Some(f) => assert_bits_eq(&got, f, &format!("hd={hd} {}", exec.isa())),
            }
        }
        // Position 0 is the identity.
        let mut x0 = x[..heads * hd].to_vec();
        rope_on(&fast(), &mut x0, heads, hd, &[0], &table);
        assert_bits_eq(&x0, &x[..heads * hd], "position 0");
    }
}

#[test]
#[should_panic(expected = "rope: position 9 >= table max_positions 8")]
fn rope_past_the_table_panics_with_the_position() {
    let table = RopeTable::new(4, 8, 10_000.0);
    let mut x = vec![0.0; 4];
    rope_on(&fast(), &mut x, 1, 4, &[9], &table);
}

#[test]
fn silu_mul_matches_reference_and_is_bitwise_identical_everywhere() {
    let mut rng = Rng::new(12);
    for inter in [1usize, 15, 16, 33, 1536] {
        for m in [1usize, 4, 23] {
            let mut gu = rng.vec(m * 2 * inter, 8.0);
            gu[0] = -120.0; // exp overflow side
            if gu.len() > 1 {
                gu[1] = 95.0;
            }
            let mut want = vec![0.0; m * inter];
            reference::silu_mul(&gu, m, inter, &mut want);
            let mut first: Option<Vec<f32>> = None;
            for exec in all_execs() {
                let mut got = vec![f32::NAN; m * inter];
                silu_mul_on(&exec, &gu, m, inter, &mut got);
                assert_close(
                    &got,
                    &want,
                    1e-6,
                    4e-7,
                    &format!("inter={inter} m={m} {}", exec.isa()),
                );
                match &first {
                    None => first = Some(got),
                    Some(f) => {
                        assert_bits_eq(&got, f, &format!("inter={inter} m={m} {}", exec.isa()))
                    }
                }
            }
        }
    }
}

#[test]
fn add_inplace_is_exact_elementwise_addition() {
    let mut rng = Rng::new(13);
    for n in [0usize, 1, 15, 16, 17, 1000] {
        let a = rng.vec(n, 1.0);
        let b = rng.vec(n, 1.0);
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        for exec in isas() {
            let mut got = a.clone();
            add_inplace_on(&exec, &mut got, &b);
            assert_bits_eq(&got, &want, &format!("n={n} {}", exec.isa()));
        }
    }
}

#[test]
fn argmax_takes_the_first_maximum_and_ignores_nan() {
    assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 3.0, 3.0]), 3);
    let mut big = vec![0.0f32; 49_152];
    big[40_000] = 1.0;
    big[45_000] = 1.0;
    assert_eq!(argmax(&big), 40_000);
}
