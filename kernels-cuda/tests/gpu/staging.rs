//! On the GPU: KV byte ranges between a device pool and page-locked host memory (the staged
//! path of disaggregated serving), and a captured graph replaying kernels. Called from the one
//! GPU test (`gpu.rs`).

use std::time::Instant;

use tandem_kernels_cuda::buffers::DeviceKvPool;
use tandem_kernels_cuda::{CudaDevice, CudaKernels, PinnedHost};
use tandem_kv_layout::{KvDtype, KvLayout};

use super::common::Rng;
use super::{down, up};

/// Copies chosen slabs out to pinned host memory and back in: exactly those bytes move, in
/// both directions; then times a large transfer each way.
pub fn check_staging(dev: &CudaDevice, rng: &mut Rng) {
    let layout = KvLayout::new(2, 2, 64, 16, KvDtype::F16, 0).unwrap();
    let nb = 6;
    let len = layout.pool_bytes(nb);
    let bytes: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
    let mut pool = super::upload_pool(dev, layout, nb, &bytes);
    let mut host = vec![0u8; len];
    // Declared after `host`: unregistered before the memory is freed.
    let pinned = unsafe { PinnedHost::register(dev, host.as_mut_ptr(), len) };
    eprintln!("kernels-cuda staging: host region page-locked: {}", pinned.as_ref().map_or_else(|e| format!("no ({e})"), |_| "yes".into()));
    let slab = |layer: usize, block: usize| layout.slab_offset(nb, layer, block);
    let ranges = [slab(0, 1)..slab(0, 3), slab(1, 4)..slab(1, 5)];
    unsafe { pool.copy_to_host(dev, &ranges, host.as_mut_ptr(), len) }.unwrap();
    dev.mark().unwrap().wait().unwrap();
    let inside = |i: usize| ranges.iter().any(|r| r.contains(&i));
    for i in 0..len {
        let want = if inside(i) { bytes[i] } else { 0 };
        assert_eq!(host[i], want, "byte {i} after copy_to_host (inside a range: {})", inside(i));
    }
    for r in &ranges {
        for b in &mut host[r.clone()] {
            *b = b.wrapping_add(1);
        }
    }
    unsafe { pool.copy_from_host(dev, &ranges, host.as_ptr(), len) }.unwrap();
    let back = down(dev, &pool.bytes);
    for i in 0..len {
        let want = if inside(i) { bytes[i].wrapping_add(1) } else { bytes[i] };
        assert_eq!(back[i], want, "byte {i} after copy_from_host");
    }
    let outside = [len..len + 1];
    assert!(unsafe { pool.copy_to_host(dev, &outside, host.as_mut_ptr(), len) }.is_err(), "a range past the end is refused");
    drop(pinned);

    // Bandwidth: 256 MiB each way between the device and page-locked host memory.
    let big = 256usize << 20;
    let big_layout = KvLayout::new(1, 1, 1024, 1024, KvDtype::F16, 0).unwrap(); // 4 MiB slabs
    let big_nb = big / big_layout.slab_bytes();
    let mut big_pool = DeviceKvPool::new(dev, big_layout, big_nb).unwrap();
    let mut big_host = vec![1u8; big];
    let big_pinned = unsafe { PinnedHost::register(dev, big_host.as_mut_ptr(), big) };
    let all = [0..big];
    let gbs = |f: &mut dyn FnMut()| {
        f();
        let t = Instant::now();
        for _ in 0..4 {
            f();
        }
        4.0 * big as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let out = gbs(&mut || {
        unsafe { big_pool.copy_to_host(dev, &all, big_host.as_mut_ptr(), big) }.unwrap();
        dev.mark().unwrap().wait().unwrap();
    });
    let inn = gbs(&mut || {
        unsafe { big_pool.copy_from_host(dev, &all, big_host.as_ptr(), big) }.unwrap();
        dev.mark().unwrap().wait().unwrap();
    });
    eprintln!(
        "kernels-cuda staging: 256 MiB device -> host {out:.1} GB/s, host -> device {inn:.1} GB/s (host memory page-locked: {})",
        big_pinned.is_ok()
    );
}

/// Captures three residual adds into a graph and replays it twice: the result is six adds, bit
/// for bit the CPU's, and nothing ran while capturing.
pub fn check_graph(dev: &CudaDevice, k: &CudaKernels, rng: &mut Rng) {
    let n = 4099;
    let a: Vec<f32> = rng.vec(n);
    let b: Vec<f32> = rng.vec(n);
    let mut ga = up(dev, &a);
    let gb = up(dev, &b);
    let graph = dev
        .capture(|| {
            for _ in 0..3 {
                k.add_inplace(&mut ga, &gb)?;
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("capturing three adds: {e}"));
    assert_eq!(down(dev, &ga), a, "capturing runs nothing");
    let t = Instant::now();
    graph.launch().unwrap();
    graph.launch().unwrap();
    let got = down(dev, &ga);
    let mut cpu = a.clone();
    for _ in 0..6 {
        tandem_kernels::add_inplace(&mut cpu, &b);
    }
    super::assert_bits("graph of 3 adds, replayed twice", &got, &cpu);
    eprintln!("kernels-cuda graph: 2 replays of 3 kernels in {:.0} µs", t.elapsed().as_secs_f64() * 1e6);
    // A capture whose closure fails ends the capture; the stream takes ordinary work again.
    let short: cudarc::driver::CudaSlice<f32> = dev.alloc_zeros(3).unwrap();
    let failed = dev.capture(|| k.add_inplace(&mut ga, &short));
    assert!(failed.is_err(), "a failing enqueue fails the capture");
    k.add_inplace(&mut ga, &gb).unwrap();
    let _ = down(dev, &ga);
}
