//! `linear` against the f64 oracle, and its bitwise invariances: any batch size, any batch
//! neighbours, any thread count, any ISA.

use crate::common;
use common::*;
use tandem_kernels::{Weight, WeightDtype, linear_on, reference};

const DTYPES: [WeightDtype; 3] = [WeightDtype::F32, WeightDtype::F16, WeightDtype::Bf16];

#[test]
fn linear_matches_the_f64_reference_for_odd_shapes_and_all_dtypes() {
    let mut rng = Rng::new(1);
    for &(rows, cols) in &[(1, 1), (5, 3), (33, 17), (64, 96), (70, 129), (100, 576)] {
        for dtype in DTYPES {
            let w = Weight::from_f32(rows, cols, rng.vec(rows * cols, 0.5), dtype).unwrap();
            for m in [1, 2, 3, 5, 9, 13] {
                let x = rng.vec(m * cols, 1.0);
                let mut want = vec![0.0; m * rows];
                reference::linear(&x, m, &w, &mut want);
                for exec in isas() {
                    let mut got = vec![f32::NAN; m * rows];
                    linear_on(&exec, &x, m, &w, &mut got);
                    let tol = 2e-6 * (cols as f32).sqrt();
                    assert_close(
                        &got,
                        &want,
                        tol,
                        1e-5,
                        &format!("{rows}x{cols} {dtype} m={m} {}", exec.isa()),
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_computes_the_same_bits_alone_or_in_any_batch_on_any_threads_and_isa() {
    let mut rng = Rng::new(2);
    for &(rows, cols) in &[(70, 45), (96, 64), (200, 33), (600, 40)] {
        for dtype in DTYPES {
            let w = Weight::from_f32(rows, cols, rng.vec(rows * cols, 0.5), dtype).unwrap();
            let probe = rng.vec(cols, 1.0);
            let mut alone = vec![0.0; rows];
            linear_on(&isas()[0], &probe, 1, &w, &mut alone);
            for m in [1usize, 2, 3, 4, 5, 7, 8, 9, 12, 13, 25, 40] {
                let mut x = rng.vec(m * cols, 1.0);
                let at = rng.below(m);
                x[at * cols..(at + 1) * cols].copy_from_slice(&probe);
                for exec in all_execs() {
                    let mut out = vec![0.0; m * rows];
                    linear_on(&exec, &x, m, &w, &mut out);
                    assert_bits_eq(
                        &out[at * rows..(at + 1) * rows],
                        &alone,
                        &format!(
                            "{rows}x{cols} {dtype} m={m} row {at} {} {}t",
                            exec.isa(),
                            exec.pool().threads()
                        ),
                    );
                }
            }
        }
    }
}

#[test]
fn large_batches_take_the_widened_path_and_still_match_single_rows() {
    // m >= 64 widens f16/bf16 panels to f32 first; the product order must not change.
    let mut rng = Rng::new(3);
    let (rows, cols) = (300, 160);
    for dtype in DTYPES {
        let w = Weight::from_f32(rows, cols, rng.vec(rows * cols, 0.5), dtype).unwrap();
        let m = 70;
        let x = rng.vec(m * cols, 1.0);
        let exec = fast();
        let mut batch = vec![0.0; m * rows];
        linear_on(&exec, &x, m, &w, &mut batch);
        for i in [0, 11, 69] {
            let mut one = vec![0.0; rows];
            linear_on(&exec, &x[i * cols..(i + 1) * cols], 1, &w, &mut one);
            assert_bits_eq(
                &batch[i * rows..(i + 1) * rows],
                &one,
                &format!("{dtype} row {i}"),
            );
        }
    }
}

#[test]
fn zero_rows_is_a_no_op_and_zero_cols_gives_zeros() {
    let w = Weight::from_f32(4, 0, vec![], WeightDtype::F32).unwrap();
    for exec in isas() {
        let mut out = vec![f32::NAN; 8];
        linear_on(&exec, &[], 2, &w, &mut out);
        assert!(out.iter().all(|&v| v == 0.0), "{}", exec.isa());
        linear_on(&exec, &[], 0, &w, &mut []);
    }
}

#[test]
#[should_panic(expected = "linear: `x (m * cols)` has length 5, expected 6")]
fn a_wrong_input_length_panics_with_the_op_name() {
    let w = Weight::from_f32(2, 3, vec![0.0; 6], WeightDtype::F32).unwrap();
    let mut out = vec![0.0; 4];
    linear_on(&fast(), &[0.0; 5], 2, &w, &mut out);
}

#[test]
fn the_plain_entry_point_uses_the_global_pool_and_matches_every_isa() {
    let mut rng = Rng::new(4);
    let (rows, cols, m) = (130, 70, 5);
    let w = Weight::from_f32(rows, cols, rng.vec(rows * cols, 0.5), WeightDtype::F16).unwrap();
    let x = rng.vec(m * cols, 1.0);
    let mut global = vec![0.0; m * rows];
    tandem_kernels::linear(&x, m, &w, &mut global);
    for exec in isas() {
        let mut out = vec![0.0; m * rows];
        linear_on(&exec, &x, m, &w, &mut out);
        assert_bits_eq(&out, &global, exec.isa().as_str());
    }
}

/// A quantized weight computes the bits of the f32 weight of its dequantized values (the loader's
/// f32 path), for every batch size, thread count and ISA: the in-register decode (`m = 1`) and
/// the decoded-panel path (`m > 1`) both.
#[test]
fn quantized_weights_give_the_bits_of_their_dequantized_f32_weight() {
    let mut rng = Rng::new(7);
    for &(rows, cols) in &[(1, 32), (33, 64), (70, 96), (200, 576)] {
        for dtype in [WeightDtype::Q8_0, WeightDtype::Q4_1, WeightDtype::Q4_0] {
            let q = Weight::from_f32(rows, cols, rng.vec(rows * cols, 0.5), dtype).unwrap();
            let deq: Vec<f32> = (0..rows * cols)
                .map(|i| q.get(i / cols, i % cols))
                .collect();
            let f = Weight::from_f32(rows, cols, deq, WeightDtype::F32).unwrap();
            for m in [1usize, 2, 3, 4, 7, 13, 64, 70] {
                let x = rng.vec(m * cols, 1.0);
                let mut want = vec![0.0; m * rows];
                linear_on(&isas()[0], &x, m, &f, &mut want);
                for exec in all_execs() {
                    let mut got = vec![f32::NAN; m * rows];
                    linear_on(&exec, &x, m, &q, &mut got);
                    let what = format!(
                        "{rows}x{cols} {dtype} m={m} {} {}t",
                        exec.isa(),
                        exec.pool().threads()
                    );
                    assert_bits_eq(&got, &want, &what);
                }
            }
        }
    }
}

#[test]
fn quantized_weights_take_the_files_bytes() {
    let (rows, cols) = (96, 576);
    for (dtype, bits) in [
        (WeightDtype::Q8_0, 8.5),
        (WeightDtype::Q4_1, 5.0),
        (WeightDtype::Q4_0, 4.5),
    ] {
        let w = Weight::from_f32(rows, cols, vec![0.25; rows * cols], dtype).unwrap();
        assert_eq!(
            w.size_bytes() as f64,
            (rows * cols) as f64 * bits / 8.0,
            "{dtype}"
        );
        assert_eq!(dtype.bits_per_weight(), bits);
    }
}
