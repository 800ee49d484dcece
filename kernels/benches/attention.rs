//! Paged attention and cache writes on the SmolLM2-135M shape (9 query heads, 3 KV heads,
//! head_dim 64, 16-token blocks), one layer.
//!
//! Decode reports KV bytes read per call (`ctx × 3 heads × 64 × 2 × elem bytes` per sequence)
//! as bytes/s; prefill reports attention FLOPs (`4 × heads × head_dim × Σ_j (j + 1)`) as
//! "elem/s"; `write_kv` reports bytes written.
//!
//! Run: `cargo bench -p tandem-kernels --bench attention` (filter: `-- decode`).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::time::Duration;
use tandem_kernels::{
    AttnSeq, KvCacheMut, KvCacheRef, KvDtype, KvLayout, paged_attention, write_kv,
};

const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HD: usize = 64;
const BS: usize = 16;

fn seeded(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// A one-layer pool holding `seqs` sequences of `ctx` tokens, blocks interleaved across
/// sequences (as a block manager hands them out), filled through `write_kv`.
struct Pool {
    layout: KvLayout,
    num_blocks: usize,
    bytes: Vec<u8>,
    tables: Vec<Vec<u32>>,
}

fn pool(dtype: KvDtype, seqs: usize, ctx: usize) -> Pool {
    let layout = KvLayout::new(1, KV_HEADS, HD, BS, dtype, 0).unwrap();
    let per = ctx.div_ceil(BS);
    let num_blocks = seqs * per;
    let mut bytes = vec![0u8; layout.pool_bytes(num_blocks)];
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| (0..per).map(|b| (b * seqs + s) as u32).collect())
        .collect();
    for (s, table) in tables.iter().enumerate() {
        let k = seeded(ctx * KV_HEADS * HD, 3 + s as u64);
        let slots: Vec<usize> = (0..ctx)
            .map(|t| table[t / BS] as usize * BS + t % BS)
            .collect();
        let mut c = KvCacheMut::new(&layout, num_blocks, &mut bytes);
        write_kv(&mut c, 0, &k, &k, &slots).unwrap();
    }
    Pool {
        layout,
        num_blocks,
        bytes,
        tables,
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1200))
        .sample_size(10);
    let scale = 1.0 / (HD as f32).sqrt();
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Int8] {
        for (ctx, batch) in [(512usize, 1usize), (2048, 1), (512, 16), (2048, 16)] {
            if dtype != KvDtype::F16 && dtype != KvDtype::F32 && (ctx, batch) != (2048, 16) {
                continue;
            }
            let p = pool(dtype, batch, ctx);
            let cache = KvCacheRef::new(&p.layout, p.num_blocks, &p.bytes);
            let q = seeded(batch * HEADS * HD, 11);
            let mut out = vec![0.0f32; q.len()];
            let seqs: Vec<AttnSeq<'_>> = (0..batch)
                .map(|s| AttnSeq {
                    block_table: &p.tables[s],
                    q_row: s,
                    q_len: 1,
                    first_pos: ctx - 1,
                })
                .collect();
            let kv_bytes = batch * ctx * KV_HEADS * HD * 2 * dtype.elem_bytes();
            g.throughput(Throughput::Bytes(kv_bytes as u64));
            g.bench_function(format!("decode/{dtype}/ctx{ctx}/batch{batch}"), |b| {
                b.iter(|| paged_attention(&cache, 0, &q, HEADS, &seqs, scale, &mut out).unwrap())
            });
        }
        if dtype == KvDtype::F32 || dtype == KvDtype::F16 {
            let len = 512;
            let p = pool(dtype, 1, len);
            let cache = KvCacheRef::new(&p.layout, p.num_blocks, &p.bytes);
            let q = seeded(len * HEADS * HD, 12);
            let mut out = vec![0.0f32; q.len()];
            let seqs = [AttnSeq {
                block_table: &p.tables[0],
                q_row: 0,
                q_len: len,
                first_pos: 0,
            }];
            let flops = 4 * HEADS * HD * len * (len + 1) / 2;
            g.throughput(Throughput::Elements(flops as u64));
            g.bench_function(format!("prefill/{dtype}/len{len}"), |b| {
                b.iter(|| paged_attention(&cache, 0, &q, HEADS, &seqs, scale, &mut out).unwrap())
            });
        }
    }
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
        let len = 512;
        let mut p = pool(dtype, 1, len);
        let k = seeded(len * KV_HEADS * HD, 13);
        let slots: Vec<usize> = (0..len)
            .map(|t| p.tables[0][t / BS] as usize * BS + t % BS)
            .collect();
        g.throughput(Throughput::Bytes(
            (2 * len * KV_HEADS * HD * dtype.elem_bytes()) as u64,
        ));
        g.bench_function(format!("write_kv/{dtype}/prefill{len}"), |b| {
            b.iter(|| {
                let mut c = KvCacheMut::new(&p.layout, p.num_blocks, &mut p.bytes);
                write_kv(&mut c, 0, &k, &k, &slots).unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
