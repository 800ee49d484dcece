//! The kernels run on a GPU and compared with `tandem-kernels` (the CPU kernels) on the same
//! inputs and the same KV bytes. One test, so that on a machine without a driver exactly one line
//! says what was not run and why (written to stderr directly, so `cargo test` shows it).
//!
//! Tolerances, stated once:
//! - bit for bit: RoPE'd q, the KV pool bytes written by the fused RoPE + KV write (f32, f16,
//!   bf16), SiLU-mul, residual add, argmax, embedding, bf16 conversions (the GPU performs the
//!   CPU's operations in the same order: `--fmad=false`, the canonical `exp`);
//! - cuBLAS linear (f32, and bf16 in / f32 out): within 1e-4 relative, 1e-3 absolute, of an f64
//!   matmul of the same values (another summation order);
//! - RMSNorm: |gpu - cpu| <= 2e-5 * max(1, |cpu|) (the sum of squares is reduced in another order);
//! - attention (decode and prefill, all KV dtypes): |gpu - cpu| <= 5e-5 (outputs are convex
//!   combinations of V rows in [-1, 1]; the softmax sums run in another order, online).

mod common;
#[path = "gpu/ipc.rs"]
mod ipc;
#[path = "gpu/staging.rs"]
mod staging;

use common::Rng;
use cudarc::driver::CudaSlice;
use std::io::Write;
use std::time::Instant;
use tandem_kernels::{AttnSeq, KvCacheMut, RopeTable};
use tandem_kernels_cuda::buffers::{DecodeWorkspace, DeviceKvPool, DeviceRopeTable};
use tandem_kernels_cuda::{CudaDevice, CudaError, CudaKernels, Out, PtxCache, launch};
use tandem_kv_layout::{KvDtype, KvLayout};

const CHECKS: &str = "cuBLAS linear f32/bf16, rms_norm, silu_mul, add_inplace, argmax, embed f32/bf16, f32<->bf16, \
                      rope+write_kv (f32/f16/bf16), paged attention decode and prefill (f32/f16/bf16, GQA, \
                      head_dim 64/80/128/256), sampling (temperature/top-k/top-p) against tandem-kernels; KV staging to pinned host memory; graph capture; \
                      XXH3 slab hashes and a second process copying into this one's pool by CUDA IPC";

fn report_not_run(why: &str) {
    let _ = writeln!(
        std::io::stderr(),
        "kernels-cuda: GPU tests not run: {why}. Skipped: {CHECKS}"
    );
}

#[test]
fn gpu_kernels_match_the_cpu_kernels() {
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(CudaError::NoDriver {
            library,
            ld_library_path,
            ..
        }) => {
            let ld = ld_library_path.unwrap_or_else(|| "unset".to_string());
            report_not_run(&format!(
                "no CUDA driver ({library} not found through the dynamic loader; LD_LIBRARY_PATH={ld})"
            ));
            return;
        }
        Err(CudaError::NoSuchDevice { count: 0, .. }) => {
            report_not_run("a CUDA driver but no CUDA device");
            return;
        }
        Err(e) => panic!("opening cuda:0: {e}"),
    };
    let cache_dir = common::temp_dir("gpu");
    let t = Instant::now();
    let k = CudaKernels::load(&dev, &PtxCache::new(&cache_dir)).unwrap_or_else(|e| panic!("{e}"));
    let _ = writeln!(
        std::io::stderr(),
        "kernels-cuda: GPU tests on {} (sm_{}{}, {} SMs, {:.1} GiB free); kernels loaded in {:.0} ms",
        dev.name(),
        dev.compute_capability().0,
        dev.compute_capability().1,
        k.sm_count(),
        dev.free_bytes_at_open() as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut rng = Rng(0x7a4d_e11a);
    check_elementwise(&dev, &k, &mut rng);
    check_rms_norm(&dev, &k, &mut rng);
    check_argmax(&dev, &k, &mut rng);
    check_sample(&dev, &k, &mut rng);
    check_embed_and_bf16(&dev, &k, &mut rng);
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        check_rope_write_kv(&dev, &k, &mut rng, dtype);
        for (n_heads, kv_heads, hd) in [(9, 3, 64), (32, 8, 128), (8, 2, 80), (4, 4, 256)] {
            check_attention(&dev, &k, &mut rng, dtype, n_heads, kv_heads, hd);
        }
    }
    check_gemm(&dev, &mut rng);
    staging::check_staging(&dev, &mut rng);
    staging::check_graph(&dev, &k, &mut rng);
    time_attention(&dev, &k, &mut rng);
    // Last: it starts a second process (bounded by a timeout), so nothing else waits on it.
    ipc::check_ipc(&dev, &PtxCache::new(&cache_dir), &mut rng);
    let _ = std::fs::remove_dir_all(&cache_dir);
}

/// Not a check of its own: the second process of `ipc::check_ipc`, which runs this binary
/// again with the parent's IPC handle in the environment. Without it (every ordinary run) it
/// returns at once.
#[test]
fn ipc_peer_process() {
    if let Ok(handle) = std::env::var(ipc::ENV_HANDLE) {
        ipc::peer(&handle);
    }
}

fn up<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    dev: &CudaDevice,
    x: &[T],
) -> CudaSlice<T> {
    dev.upload(x).unwrap_or_else(|e| panic!("{e}"))
}

fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
) -> Vec<T> {
    dev.download(x).unwrap_or_else(|e| panic!("{e}"))
}

fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    dev: &CudaDevice,
    n: usize,
) -> CudaSlice<T> {
    dev.alloc_zeros(n).unwrap_or_else(|e| panic!("{e}"))
}

/// Microseconds per call of `f` (queued work included): one warm-up call, then `iters` timed.
fn time_us(dev: &CudaDevice, iters: usize, f: &mut dyn FnMut()) -> f64 {
    f();
    dev.synchronize().unwrap();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    dev.synchronize().unwrap();
    t.elapsed().as_secs_f64() * 1e6 / iters as f64
}

fn assert_bits(what: &str, gpu: &[f32], cpu: &[f32]) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: length");
    if let Some(i) = (0..gpu.len()).find(|&i| gpu[i].to_bits() != cpu[i].to_bits()) {
        let n = (0..gpu.len())
            .filter(|&i| gpu[i].to_bits() != cpu[i].to_bits())
            .count();
        panic!(
            "{what}: {n} of {} elements differ in bits; first at {i}: gpu {} cpu {}",
            gpu.len(),
            gpu[i],
            cpu[i]
        );
    }
}

/// Max |gpu - cpu| / max(1, |cpu|) <= rel and max |gpu - cpu| <= abs.
fn assert_close(what: &str, gpu: &[f32], cpu: &[f32], abs: f32, rel: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: length");
    let mut worst = (0usize, 0.0f32);
    for i in 0..gpu.len() {
        let d = (gpu[i] - cpu[i]).abs();
        assert!(
            !gpu[i].is_nan() || cpu[i].is_nan(),
            "{what}: NaN at {i} (cpu {})",
            cpu[i]
        );
        if d > worst.1 {
            worst = (i, d);
        }
        assert!(
            d <= abs && d <= rel * cpu[i].abs().max(1.0),
            "{what}: element {i}: gpu {} cpu {} (|diff| {d}, limits abs {abs} rel {rel})",
            gpu[i],
            cpu[i]
        );
    }
    eprintln!("{what}: max |diff| {} at {}", worst.1, worst.0);
}

fn check_elementwise(dev: &CudaDevice, k: &CudaKernels, rng: &mut Rng) {
    let (m, inter) = (5, 1536);
    let gate_up: Vec<f32> = rng.vec(m * 2 * inter).iter().map(|x| x * 8.0).collect();
    let mut cpu = vec![0.0f32; m * inter];
    tandem_kernels::silu_mul(&gate_up, m, inter, &mut cpu);
    let g = up(dev, &gate_up);
    let mut out = zeros::<f32>(dev, m * inter);
    k.silu_mul(&g, m, inter, &mut out).unwrap();
    assert_bits("silu_mul", &down(dev, &out), &cpu);

    let a = rng.vec(100_003);
    let b = rng.vec(100_003);
    let mut cpu = a.clone();
    tandem_kernels::add_inplace(&mut cpu, &b);
    let mut ga = up(dev, &a);
    k.add_inplace(&mut ga, &up(dev, &b)).unwrap();
    assert_bits("add_inplace", &down(dev, &ga), &cpu);
}

fn check_rms_norm(dev: &CudaDevice, k: &CudaKernels, rng: &mut Rng) {
    for (rows, n) in [(1, 576), (7, 576), (3, 4096), (2, 8192), (4, 100)] {
        let x: Vec<f32> = rng.vec(rows * n).iter().map(|v| v * 3.0).collect();
        let w: Vec<f32> = rng.vec(n).iter().map(|v| 1.0 + 0.5 * v).collect();
        let mut cpu = vec![0.0f32; rows * n];
        tandem_kernels::rms_norm(&x, &w, 1e-5, &mut cpu);
        let mut out = zeros::<f32>(dev, rows * n);
        k.rms_norm(&up(dev, &x), &up(dev, &w), 1e-5, &mut out)
            .unwrap();
        assert_close(
            &format!("rms_norm {rows}x{n}"),
            &down(dev, &out),
            &cpu,
            1.0,
            2e-5,
        );
    }
}

fn check_argmax(dev: &CudaDevice, k: &CudaKernels, rng: &mut Rng) {
    let vocab = 49_152;
    let mut rows: Vec<Vec<f32>> = (0..6).map(|_| rng.vec(vocab)).collect();
    rows[1][100] = 5.0; // ties: the lowest index wins
    rows[1][40_000] = 5.0;
    rows[1][7] = 5.0;
    rows[2].iter_mut().for_each(|v| *v = f32::NAN); // all NaN: 0
    rows[3].iter_mut().for_each(|v| *v = f32::NEG_INFINITY); // all -inf: 0
    rows[3][4000] = f32::NAN;
    rows[4][0] = f32::NAN; // NaN never wins
    rows[4][123] = 9.0;
    rows[4][124] = f32::NAN;
    rows[5].iter_mut().for_each(|v| *v = 0.0); // +0 and -0 compare equal: first wins
    rows[5][10] = -0.0;
    rows[5][3] = -0.0;
    let flat: Vec<f32> = rows.concat();
    let cpu: Vec<i32> = rows
        .iter()
        .map(|r| tandem_kernels::argmax(r) as i32)
        .collect();
    let mut out = zeros::<i32>(dev, rows.len());
    k.argmax(&up(dev, &flat), vocab, &mut out).unwrap();
    assert_eq!(down(dev, &out), cpu, "argmax");
    assert_eq!(cpu[1], 7);
}

/// `sample.cu` picks tandem-kernels `sample`'s token on every case (`common::sample_cases`), then
/// its time beside argmax's at SmolLM2's and Llama 3's vocabularies.
fn check_sample(dev: &CudaDevice, k: &CudaKernels, rng: &mut Rng) {
    use tandem_kernels::sample::{SampleSpec, sample};
    use tandem_kernels_cuda::SampleRow;
    for vocab in [7usize, 1000, 49_152, 128_256] {
        let cases = common::sample_cases(vocab, rng);
        let flat: Vec<f32> = cases.iter().flat_map(|(r, _)| r.iter().copied()).collect();
        let specs: Vec<SampleRow> = cases.iter().map(|(_, s)| SampleRow::from(s)).collect();
        let mut out = zeros::<i32>(dev, cases.len());
        k.sample(&up(dev, &flat), vocab, &up(dev, &specs), &mut out).unwrap();
        let got = down(dev, &out);
        for (n, ((row, spec), &g)) in cases.iter().zip(&got).enumerate() {
            assert_eq!(g as usize, sample(row, spec), "sample: vocab {vocab}, case {n}: {spec:?}");
        }
    }
    for vocab in [49_152usize, 128_256] {
        for rows in [1usize, 64, 256] {
            let logits = up(dev, &(0..rows * vocab).map(|_| rng.normal(3.0)).collect::<Vec<f32>>());
            let spec = SampleSpec { temperature: 0.8, top_k: 0, top_p: 0.95, draw: rng.next_u64() >> 11 };
            let specs = up(dev, &vec![SampleRow::from(&spec); rows]);
            let mut out = zeros::<i32>(dev, rows);
            let s_us = time_us(dev, 20, &mut || k.sample(&logits, vocab, &specs, &mut out).unwrap());
            let a_us = time_us(dev, 20, &mut || k.argmax(&logits, vocab, &mut out).unwrap());
            let _ = writeln!(
                std::io::stderr(),
                "kernels-cuda: sample (T 0.8, top-p 0.95) vocab {vocab} x {rows} rows: {s_us:.1} us (argmax {a_us:.1} us)"
            );
        }
    }
}

fn check_embed_and_bf16(dev: &CudaDevice, k: &CudaKernels, rng: &mut Rng) {
    let (vocab, hidden) = (1000, 96);
    let table = rng.vec(vocab * hidden);
    let ids: Vec<i32> = vec![0, 999, 5, 5, 1000, -1, 17];
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            if (0..vocab as i32).contains(&id) {
                table[id as usize * hidden..(id as usize + 1) * hidden].to_vec()
            } else {
                vec![0.0; hidden]
            }
        })
        .collect();
    let gids = up(dev, &ids);
    let mut out = zeros::<f32>(dev, ids.len() * hidden);
    k.embed_f32(&gids, &up(dev, &table), hidden, &mut out)
        .unwrap();
    assert_bits("embed_f32", &down(dev, &out), &want);

    let table16: Vec<u16> = table
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect();
    let want16: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            (0..hidden).map(move |c| {
                if (0..vocab as i32).contains(&id) {
                    id as usize * hidden + c
                } else {
                    usize::MAX
                }
            })
        })
        .map(|i| {
            if i == usize::MAX {
                0.0
            } else {
                half::bf16::from_bits(table16[i]).to_f32()
            }
        })
        .collect();
    k.embed_bf16(&gids, &up(dev, &table16), hidden, &mut out)
        .unwrap();
    assert_bits("embed_bf16", &down(dev, &out), &want16);

    let mut x = rng.vec(10_000);
    x.extend([
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        f32::MIN_POSITIVE / 3.0,
        f32::MAX,
        f32::from_bits(0x3f80_8000), // exactly half way: ties to even
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x7f7f_ffff),
    ]);
    let want: Vec<u16> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let mut out16 = zeros::<u16>(dev, x.len());
    k.f32_to_bf16(&up(dev, &x), &mut out16).unwrap();
    assert_eq!(down(dev, &out16), want, "f32_to_bf16");
    let back: Vec<f32> = want
        .iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect();
    let mut outf = zeros::<f32>(dev, x.len());
    k.bf16_to_f32(&out16, &mut outf).unwrap();
    assert_bits("bf16_to_f32", &down(dev, &outf), &back);
}

fn check_rope_write_kv(dev: &CudaDevice, k: &CudaKernels, rng: &mut Rng, dtype: KvDtype) {
    let (n_heads, kv_heads, hd, bs, nb, layers) = (9, 3, 64, 16, 40, 2);
    let layout = KvLayout::new(layers, kv_heads, hd, bs, dtype, 0).unwrap();
    let max_pos = 4096;
    let t = 37;
    let positions: Vec<usize> = (0..t).map(|_| rng.below(max_pos)).collect();
    let slots: Vec<usize> = rng.perm(nb * bs)[..t].to_vec();
    let q = rng.vec(t * n_heads * hd);
    let kk = rng.vec(t * kv_heads * hd);
    let v = rng.vec(t * kv_heads * hd);

    let table = RopeTable::new(hd, max_pos, 10_000.0);
    let mut q_cpu = q.clone();
    tandem_kernels::rope(&mut q_cpu, n_heads, hd, &positions, &table);
    let mut k_cpu = kk.clone();
    tandem_kernels::rope(&mut k_cpu, kv_heads, hd, &positions, &table);
    let mut bytes = vec![0u8; layout.pool_bytes(nb)];
    let mut cache = KvCacheMut::new(&layout, nb, &mut bytes);
    tandem_kernels::write_kv(&mut cache, 1, &k_cpu, &v, &slots).unwrap();

    let rope = DeviceRopeTable::new(dev, &table).unwrap();
    let mut pool = DeviceKvPool::new(dev, layout, nb).unwrap();
    let mut gq = up(dev, &q);
    let pos32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let slots64: Vec<i64> = slots.iter().map(|&s| s as i64).collect();
    k.rope_write_kv(
        &mut gq,
        &up(dev, &kk),
        &up(dev, &v),
        n_heads,
        &rope,
        &up(dev, &pos32),
        &up(dev, &slots64),
        &mut pool,
        1,
    )
    .unwrap();
    assert_bits(&format!("rope q ({dtype})"), &down(dev, &gq), &q_cpu);
    let got = down(dev, &pool.bytes);
    if let Some(i) = (0..got.len()).find(|&i| got[i] != bytes[i]) {
        panic!(
            "rope_write_kv ({dtype}): pool bytes differ first at byte {i} (layer-0 region ends at {})",
            layout.pool_bytes(nb) / layers
        );
    }
}

/// Fills `layer` of a CPU pool with random K and V for every slot (through the CPU `write_kv`).
fn random_pool(rng: &mut Rng, layout: &KvLayout, nb: usize, layer: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; layout.pool_bytes(nb)];
    let mut cache = KvCacheMut::new(layout, nb, &mut bytes);
    let slots: Vec<usize> = (0..nb * layout.block_size_tokens).collect();
    let row = layout.num_kv_heads * layout.head_dim;
    let kk = rng.vec(slots.len() * row);
    let v = rng.vec(slots.len() * row);
    tandem_kernels::write_kv(&mut cache, layer, &kk, &v, &slots).unwrap();
    bytes
}

fn upload_pool(dev: &CudaDevice, layout: KvLayout, nb: usize, bytes: &[u8]) -> DeviceKvPool {
    let mut pool = DeviceKvPool::new(dev, layout, nb).unwrap();
    dev.stream().memcpy_htod(bytes, &mut *pool.bytes).unwrap();
    pool
}

/// Block tables of sequences with `ctx` tokens each, drawn without replacement from the pool.
fn tables(rng: &mut Rng, ctxs: &[usize], bs: usize, nb: usize) -> Vec<Vec<u32>> {
    let perm = rng.perm(nb);
    let mut at = 0;
    ctxs.iter()
        .map(|&c| {
            let n = c.div_ceil(bs);
            let t: Vec<u32> = perm[at..at + n].iter().map(|&b| b as u32).collect();
            at += n;
            t
        })
        .collect()
}

fn padded(tables: &[Vec<u32>], width: usize) -> Vec<u32> {
    tables
        .iter()
        .flat_map(|t| {
            let mut r = t.clone();
            r.resize(width, 0);
            r
        })
        .collect()
}

fn check_attention(
    dev: &CudaDevice,
    k: &CudaKernels,
    rng: &mut Rng,
    dtype: KvDtype,
    n_heads: usize,
    kv_heads: usize,
    hd: usize,
) {
    let (bs, nb, layer) = (16, 320, 1);
    let layout = KvLayout::new(2, kv_heads, hd, bs, dtype, 0).unwrap();
    let bytes = random_pool(rng, &layout, nb, layer);
    let pool = upload_pool(dev, layout, nb, &bytes);
    let cpu_cache = tandem_kernels::KvCacheRef::new(&layout, nb, &bytes);
    let scale = 1.0 / (hd as f32).sqrt();
    let row = n_heads * hd;
    let tag = format!("{dtype} {n_heads}/{kv_heads}x{hd}");

    // Decode: a batch of contexts across block boundaries, then one long context alone (split).
    for ctxs in [vec![1usize, 16, 17, 300, 2048], vec![2048], vec![4000]] {
        let tabs = tables(rng, &ctxs, bs, nb);
        let q: Vec<f32> = rng.vec(ctxs.len() * row).iter().map(|x| x * 3.0).collect();
        let seqs: Vec<AttnSeq<'_>> = ctxs
            .iter()
            .zip(&tabs)
            .enumerate()
            .map(|(i, (&c, t))| AttnSeq {
                block_table: t,
                q_row: i,
                q_len: 1,
                first_pos: c - 1,
            })
            .collect();
        let mut cpu = vec![0.0f32; q.len()];
        tandem_kernels::paged_attention(&cpu_cache, layer, &q, n_heads, &seqs, scale, &mut cpu)
            .unwrap();
        let max_ctx = *ctxs.iter().max().unwrap();
        let width = max_ctx.div_ceil(bs);
        let ctx32: Vec<i32> = ctxs.iter().map(|&c| c as i32).collect();
        let mut ws =
            DecodeWorkspace::new(dev, ctxs.len(), n_heads, hd, launch::MAX_DECODE_SPLITS).unwrap();
        let mut out = zeros::<f32>(dev, q.len());
        let plan = k
            .paged_attn_decode(
                &up(dev, &q),
                n_heads,
                &pool,
                layer,
                &up(dev, &padded(&tabs, width)),
                width,
                &up(dev, &ctx32),
                max_ctx,
                scale,
                &mut ws,
                &mut out,
            )
            .unwrap();
        if ctxs.len() == 1 {
            assert!(plan.num_splits > 1, "one long sequence is split: {plan:?}");
        }
        assert_close(
            &format!("decode {tag} ctx {ctxs:?} ({plan:?})"),
            &down(dev, &out),
            &cpu,
            5e-5,
            5e-5,
        );
    }

    // Prefill: a fresh prompt, a later chunk of another, a single token, a long chunk far in.
    let chunks = [(0usize, 37usize), (100, 20), (0, 1), (500, 70), (31, 16)];
    let ctxs: Vec<usize> = chunks.iter().map(|&(p, n)| p + n).collect();
    let tabs = tables(rng, &ctxs, bs, nb);
    let mut q_rows = Vec::new();
    let mut r = 0;
    for &(_, n) in &chunks {
        q_rows.push(r);
        r += n;
    }
    let q: Vec<f32> = rng.vec(r * row).iter().map(|x| x * 3.0).collect();
    let seqs: Vec<AttnSeq<'_>> = chunks
        .iter()
        .zip(&tabs)
        .zip(&q_rows)
        .map(|((&(p, n), t), &qr)| AttnSeq {
            block_table: t,
            q_row: qr,
            q_len: n,
            first_pos: p,
        })
        .collect();
    let mut cpu = vec![0.0f32; q.len()];
    tandem_kernels::paged_attention(&cpu_cache, layer, &q, n_heads, &seqs, scale, &mut cpu)
        .unwrap();
    let width = ctxs.iter().max().unwrap().div_ceil(bs);
    let i32s = |v: Vec<usize>| v.into_iter().map(|x| x as i32).collect::<Vec<i32>>();
    let mut out = zeros::<f32>(dev, q.len());
    k.paged_attn_prefill(
        &up(dev, &q),
        n_heads,
        &pool,
        layer,
        &up(dev, &padded(&tabs, width)),
        width,
        &up(dev, &i32s(q_rows.clone())),
        &up(dev, &i32s(chunks.iter().map(|c| c.1).collect())),
        &up(dev, &i32s(chunks.iter().map(|c| c.0).collect())),
        chunks.iter().map(|c| c.1).max().unwrap(),
        scale,
        &mut out,
    )
    .unwrap();
    assert_close(
        &format!("prefill {tag} chunks {chunks:?}"),
        &down(dev, &out),
        &cpu,
        5e-5,
        5e-5,
    );
}

/// First timings for the GPU session (not assertions): SmolLM2's attention shape.
fn time_attention(dev: &CudaDevice, k: &CudaKernels, rng: &mut Rng) {
    let (n_heads, kv_heads, hd, bs, nb) = (9, 3, 64, 16, 2048);
    let layout = KvLayout::new(1, kv_heads, hd, bs, KvDtype::Bf16, 0).unwrap();
    let pool = DeviceKvPool::new(dev, layout, nb).unwrap();
    let scale = 0.125;
    for (seqs, ctx) in [(1usize, 2048usize), (32, 96), (256, 96)] {
        let width = ctx.div_ceil(bs);
        let tabs: Vec<u32> = (0..seqs * width).map(|i| (i % nb) as u32).collect();
        let ctx32 = vec![ctx as i32; seqs];
        let q = up(dev, &rng.vec(seqs * n_heads * hd));
        let (tabs, ctx32) = (up(dev, &tabs), up(dev, &ctx32));
        let mut ws =
            DecodeWorkspace::new(dev, seqs, n_heads, hd, launch::MAX_DECODE_SPLITS).unwrap();
        let mut out = zeros::<f32>(dev, seqs * n_heads * hd);
        let mut run = || {
            k.paged_attn_decode(
                &q, n_heads, &pool, 0, &tabs, width, &ctx32, ctx, scale, &mut ws, &mut out,
            )
            .unwrap();
        };
        let us = time_us(dev, 100, &mut run);
        let _ = writeln!(
            std::io::stderr(),
            "kernels-cuda: decode bf16 9/3x64, {seqs} seqs x ctx {ctx}: {us:.1} us/call (launches included)"
        );
    }
    let n = 512;
    let tabs: Vec<u32> = (0..n / bs).map(|i| i as u32).collect();
    let q = up(dev, &rng.vec(n * n_heads * hd));
    let mut out = zeros::<f32>(dev, n * n_heads * hd);
    let (tabs, rows, lens, first) = (
        up(dev, &tabs),
        up(dev, &[0i32]),
        up(dev, &[n as i32]),
        up(dev, &[0i32]),
    );
    let mut run = || {
        k.paged_attn_prefill(
            &q,
            n_heads,
            &pool,
            0,
            &tabs,
            n / bs,
            &rows,
            &lens,
            &first,
            n,
            scale,
            &mut out,
        )
        .unwrap()
    };
    run();
    dev.synchronize().unwrap();
    let t = Instant::now();
    for _ in 0..20 {
        run();
    }
    dev.synchronize().unwrap();
    let us = t.elapsed().as_secs_f64() * 1e6 / 20.0;
    let _ = writeln!(
        std::io::stderr(),
        "kernels-cuda: prefill bf16 9/3x64, 512 tokens: {us:.1} us/call"
    );
}

/// cuBLAS linear layers (`Gemm`) against a plain f64 matmul over the same (bf16-rounded) values,
/// on a row range of a larger weight (as the engine takes Q, K and V from the fused matrix):
/// f32 within 1e-4 relative (1e-3 absolute), bf16 inputs likewise (the products
/// of bf16 values are exact in f32; only the sum order differs).
fn check_gemm(dev: &CudaDevice, rng: &mut Rng) {
    use tandem_kernels_cuda::Gemm;
    let g = Gemm::new(dev).unwrap_or_else(|e| panic!("{e}"));
    let (m, n_all, k, r0, r1) = (5usize, 96usize, 200usize, 24usize, 88usize);
    let n = r1 - r0;
    let bf = |v: f32| half::bf16::from_f32(v);
    let x = rng.vec(m * k);
    let w = rng.vec(n_all * k);
    let want = |xs: &[f32], ws: &[f32]| -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|t| xs[i * k + t] as f64 * ws[(r0 + j) * k + t] as f64).sum();
                out[i * n + j] = s as f32;
            }
        }
        out
    };
    let wd = up(dev, &w);
    let mut out = zeros::<f32>(dev, m * n);
    g.linear_f32(&up(dev, &x), m, &wd.slice(r0 * k..r1 * k), n, k, &mut out, Out::Set)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_close("linear_f32", &down(dev, &out), &want(&x, &w), 1e-3, 1e-4);
    // The residual add folded into the epilogue: out += x · Wᵀ on a random `out`.
    let resid = rng.vec(m * n);
    let mut acc = up(dev, &resid);
    g.linear_f32(&up(dev, &x), m, &wd.slice(r0 * k..r1 * k), n, k, &mut acc, Out::Add)
        .unwrap_or_else(|e| panic!("{e}"));
    let plus = |p: Vec<f32>| -> Vec<f32> { p.iter().zip(&resid).map(|(a, b)| a + b).collect() };
    assert_close("linear_f32 (Out::Add)", &down(dev, &acc), &plus(want(&x, &w)), 1e-3, 1e-4);
    let (xb, wb): (Vec<f32>, Vec<f32>) = (
        x.iter().map(|&v| bf(v).to_f32()).collect(),
        w.iter().map(|&v| bf(v).to_f32()).collect(),
    );
    let bits = |v: &[f32]| v.iter().map(|&a| bf(a).to_bits()).collect::<Vec<u16>>();
    let wbd = up(dev, &bits(&w));
    g.linear_bf16(&up(dev, &bits(&x)), m, &wbd.slice(r0 * k..r1 * k), n, k, &mut out, Out::Set)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_close("linear_bf16", &down(dev, &out), &want(&xb, &wb), 1e-3, 1e-4);
    let mut acc = up(dev, &resid);
    g.linear_bf16(&up(dev, &bits(&x)), m, &wbd.slice(r0 * k..r1 * k), n, k, &mut acc, Out::Add)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_close("linear_bf16 (Out::Add)", &down(dev, &acc), &plus(want(&xb, &wb)), 1e-3, 1e-4);
    assert!(matches!(
        g.linear_f32(&up(dev, &x), m + 1, &wd, n_all, k, &mut out, Out::Set),
        Err(CudaError::Shape { .. })
    ));
}
