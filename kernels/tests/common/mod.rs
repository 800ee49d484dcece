//! Shared test helpers: a seeded RNG, executors for every supported ISA and thread count, and
//! bitwise / tolerance comparisons.
#![allow(dead_code)]

use std::sync::OnceLock;
use tandem_kernels::{Exec, Isa, WorkerPool};

/// SplitMix64: tiny, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * amp).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Pools of 1, 2 and 3 threads, shared by all tests in a binary.
pub fn pools() -> &'static [WorkerPool] {
    static POOLS: OnceLock<Vec<WorkerPool>> = OnceLock::new();
    POOLS.get_or_init(|| (1..=3).map(|n| WorkerPool::new(n).unwrap()).collect())
}

/// One executor per supported ISA, on the 2-thread pool.
pub fn isas() -> Vec<Exec<'static>> {
    Isa::supported()
        .into_iter()
        .map(|isa| Exec::new(&pools()[1], isa).unwrap())
        .collect()
}

/// Every (thread count, ISA) combination that runs fast (portable only single-threaded).
pub fn all_execs() -> Vec<Exec<'static>> {
    let mut v = Vec::new();
    for isa in Isa::supported() {
        for p in pools() {
            v.push(Exec::new(p, isa).unwrap());
        }
    }
    v
}

/// The fastest ISA on the 3-thread pool.
pub fn fast() -> Exec<'static> {
    Exec::new(&pools()[2], Isa::best()).unwrap()
}

#[track_caller]
pub fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: element {i}: {x} vs {y}");
    }
}

/// `|a - b| <= atol + rtol * |b|` elementwise.
#[track_caller]
pub fn assert_close(a: &[f32], b: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= atol + rtol * y.abs(),
            "{what}: element {i}: {x} vs reference {y}"
        );
    }
}
