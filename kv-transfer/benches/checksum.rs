//! The data-path hot loops, against memcpy of the same bytes in the same run: XXH3 of a slab
//! (xxhash-rust's compile-time SSE2 path vs ours with AVX2 detected at run time), and the fused
//! copy+checksum the sender uses to write into a mapped peer pool, one slab at a time and four
//! slabs interleaved (`slab_checksums`, `copy_slabs_with_checksums`, AVX-512, with and without
//! non-temporal stores). Slabs are 64 KiB (one 70B-layout (layer, block) slab); "hot" reuses four
//! slabs (cache-resident), "dram" walks a 256 MiB pool.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tandem_kv_transfer::checksum::{
    copy_slabs_with_checksums, copy_with_checksum, slab_checksum, slab_checksums,
};

const SLAB_BYTES: usize = 64 << 10;
const POOL_BYTES: usize = 256 << 20;

fn pool(seed: u8) -> Vec<u8> {
    (0..POOL_BYTES + 64)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn bench(c: &mut Criterion) {
    let src = pool(1);
    let mut dst_buf = pool(2);
    // Streaming stores need 64-byte-aligned destinations (as pool slabs are).
    let skip = dst_buf.as_ptr().align_offset(64);
    let dst = &mut dst_buf[skip..skip + POOL_BYTES];
    for (name, span) in [("hot", 4 * SLAB_BYTES), ("dram", POOL_BYTES)] {
        let mut g = c.benchmark_group(format!("slab_64k_{name}"));
        g.throughput(Throughput::Bytes(span as u64));
        g.bench_function("memcpy", |b| {
            b.iter(|| {
                for (s, d) in src[..span]
                    .chunks(SLAB_BYTES)
                    .zip(dst[..span].chunks_mut(SLAB_BYTES))
                {
                    d.copy_from_slice(black_box(s));
                }
            })
        });
        g.bench_function("xxh3_xxhash_rust", |b| {
            b.iter(|| {
                src[..span]
                    .chunks(SLAB_BYTES)
                    .map(xxhash_rust::xxh3::xxh3_64)
                    .fold(0, |a, h| a ^ h)
            })
        });
        g.bench_function("slab_checksum", |b| {
            b.iter(|| {
                src[..span]
                    .chunks(SLAB_BYTES)
                    .map(slab_checksum)
                    .fold(0, |a, h| a ^ h)
            })
        });
        g.bench_function("copy_with_checksum", |b| {
            b.iter(|| {
                let mut acc = 0;
                for (s, d) in src[..span]
                    .chunks(SLAB_BYTES)
                    .zip(dst[..span].chunks_mut(SLAB_BYTES))
                {
                    // SAFETY: `d` is a distinct, writable slab of the same length.
                    acc ^= unsafe { copy_with_checksum(s, d.as_mut_ptr()) };
                }
                acc
            })
        });
        g.bench_function("slab_checksums_x4", |b| {
            b.iter(|| {
                let slabs: Vec<&[u8]> = src[..span].chunks(SLAB_BYTES).collect();
                let mut sums = Vec::with_capacity(slabs.len());
                slab_checksums(&slabs, &mut sums);
                sums
            })
        });
        for (label, streaming) in [("plain", false), ("streaming", true)] {
            g.bench_function(format!("copy_slabs_with_checksums_{label}"), |b| {
                b.iter(|| {
                    let base = dst.as_mut_ptr();
                    let pairs: Vec<(&[u8], *mut u8)> = src[..span]
                        .chunks(SLAB_BYTES)
                        .enumerate()
                        .map(|(i, s)| (s, base.wrapping_add(i * SLAB_BYTES)))
                        .collect();
                    let mut sums = Vec::with_capacity(pairs.len());
                    // SAFETY: every destination is a distinct, writable slab of `dst`.
                    unsafe { copy_slabs_with_checksums(&pairs, streaming, &mut sums) };
                    sums
                })
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
