//! CUDA IPC on the GPU: the slab-hash kernel against the CPU's XXH3, then a second process (this
//! test binary again, `ipc_peer_process`) opening this process's KV pool by its IPC handle and
//! copying its own blocks into it, scattered; this process checks every byte and the checksums,
//! and reports the copy bandwidth.

use std::io::Write;
use std::time::Instant;

use tandem_kernels_cuda::buffers::DeviceKvPool;
use tandem_kernels_cuda::{CudaDevice, KvDeviceAccess, PtxCache};
use tandem_kv_layout::{KvDtype, KvLayout};

use super::common::Rng;

/// Environment of the peer process: the handle (hex), the pool's bytes, the seed of its blocks.
pub const ENV_HANDLE: &str = "TANDEM_TEST_IPC_HANDLE";
const ENV_SEED: &str = "TANDEM_TEST_IPC_SEED";

/// 4 layers × 1,024 blocks of 64 KiB slabs (bf16, 8 KV heads × 128, 16 tokens): 256 MiB.
fn layout() -> (KvLayout, usize) {
    (KvLayout::new(4, 8, 128, 16, KvDtype::Bf16, 0).unwrap(), 1024)
}

fn bytes_of(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng(seed);
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        v.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Where the peer puts its block `b`: a scattered permutation.
fn dst_block(b: usize, nb: usize) -> usize {
    (b * 7 + 3) % nb
}

fn slab_pairs(layout: &KvLayout, nb: usize) -> Vec<(usize, usize)> {
    (0..layout.num_layers)
        .flat_map(|l| (0..nb).map(move |b| (l, b)))
        .map(|(l, b)| (layout.slab_offset(nb, l, b), layout.slab_offset(nb, l, dst_block(b, nb))))
        .collect()
}

pub fn check_ipc(dev: &CudaDevice, cache: &PtxCache, rng: &mut Rng) {
    // The hash kernel on every length class, at aligned and unaligned offsets.
    let small = KvLayout::new(2, 2, 64, 16, KvDtype::F16, 0).unwrap();
    let nb = 8;
    let data = bytes_of(rng.next_u64(), small.pool_bytes(nb));
    let pool = super::upload_pool(dev, small, nb, &data);
    let access = KvDeviceAccess::new(dev, &pool, cache).unwrap_or_else(|e| panic!("{e}"));
    for len in [0usize, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 240, 241, 1024, 1025, 4096, 8192] {
        let offsets: Vec<u64> = [0u64, 3, 8, 1001, 5000].into_iter().filter(|&o| o as usize + len <= data.len()).collect();
        let got = access.hash_slabs(&offsets, len).unwrap_or_else(|e| panic!("{e}"));
        for (o, h) in offsets.iter().zip(got) {
            let o = *o as usize;
            assert_eq!(h, xxhash_rust::xxh3::xxh3_64(&data[o..o + len]), "XXH3 of {len} bytes at {o}");
        }
    }
    assert!(access.hash_slabs(&[data.len() as u64 - 10], 11).is_err(), "a slab past the pool is refused");

    // A second process copies into this one's pool by its IPC handle.
    let (layout, nb) = layout();
    let target = DeviceKvPool::new(dev, layout, nb).unwrap_or_else(|e| panic!("{e}"));
    let access = KvDeviceAccess::new(dev, &target, cache).unwrap_or_else(|e| panic!("{e}"));
    let handle = access.ipc_handle().unwrap_or_else(|e| panic!("cuIpcGetMemHandle: {e}"));
    let seed = rng.next_u64();
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args(["--exact", "ipc_peer_process", "--nocapture", "--test-threads=1"])
        .env(ENV_HANDLE, handle.iter().map(|b| format!("{b:02x}")).collect::<String>())
        .env(ENV_SEED, seed.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Bounded: a peer stuck in the driver must not hang the whole GPU check.
    let deadline = Instant::now() + std::time::Duration::from_secs(90);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the IPC peer process did not finish within 90 s (killed)");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the peer process failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("IPC_PEER ")).unwrap_or_else(|| panic!("no result line:\n{stdout}"));
    // Every byte where the peer put it.
    let src = bytes_of(seed, layout.pool_bytes(nb));
    let got = dev.download(&target.bytes).unwrap();
    let slab = layout.slab_bytes();
    for (s, d) in slab_pairs(&layout, nb) {
        assert!(got[d..d + slab] == src[s..s + slab], "slab at {d} is not the peer's slab at {s}");
    }
    // The device's checksums of what landed equal the CPU's.
    let offsets: Vec<u64> = slab_pairs(&layout, nb).iter().map(|p| p.1 as u64).collect();
    let sums = access.hash_slabs(&offsets, slab).unwrap();
    for ((_, d), h) in slab_pairs(&layout, nb).iter().zip(sums) {
        assert_eq!(h, xxhash_rust::xxh3::xxh3_64(&got[*d..d + slab]));
    }
    let _ = writeln!(std::io::stderr(), "kernels-cuda IPC: a second process copied 256 MiB into this one's pool, every slab verified; {}", &line[9..]);
}

/// The peer: opens the parent's pool and copies its own (seeded) blocks into it, scattered,
/// with the checksums of every source slab checked against the CPU; then times whole-pool
/// copies. Prints one `IPC_PEER ...` line.
pub fn peer(handle_hex: &str) {
    let seed: u64 = std::env::var(ENV_SEED).unwrap().parse().unwrap();
    let handle: [u8; 64] = std::array::from_fn(|i| u8::from_str_radix(&handle_hex[2 * i..2 * i + 2], 16).unwrap());
    let dev = CudaDevice::open(0).unwrap();
    let cache = PtxCache::new(super::common::temp_dir("gpu-ipc-peer"));
    let (layout, nb) = layout();
    let src = bytes_of(seed, layout.pool_bytes(nb));
    let pool = super::upload_pool(&dev, layout, nb, &src);
    let access = KvDeviceAccess::new(&dev, &pool, &cache).unwrap();
    let t = Instant::now();
    let peer = access.open_peer(&handle, layout.pool_bytes(nb)).unwrap_or_else(|e| panic!("cuIpcOpenMemHandle: {e}"));
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    let slab = layout.slab_bytes();
    let pairs = slab_pairs(&layout, nb);
    let t = Instant::now();
    let sums = peer.copy_and_hash(&pairs, slab, None).unwrap();
    let scattered_s = t.elapsed().as_secs_f64();
    for ((s, _), h) in pairs.iter().zip(&sums) {
        assert_eq!(*h, xxhash_rust::xxh3::xxh3_64(&src[*s..s + slab]), "source checksum at {s}");
    }
    // Whole-pool copies (one run), after the scattered one: its bytes are what the parent checks.
    let len = layout.pool_bytes(nb);
    let whole: Vec<(usize, usize)> = (0..len / slab).map(|i| (i * slab, i * slab)).collect();
    let mut best = f64::MAX;
    let saved = pairs.clone();
    for _ in 0..3 {
        let t = Instant::now();
        peer.copy_and_hash(&whole, slab, None).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    // Put the scattered layout back for the parent's check.
    peer.copy_and_hash(&saved, slab, None).unwrap();
    let gb = len as f64 / 1e9;
    println!(
        "IPC_PEER open {open_ms:.2} ms; scattered copy+hash of {} slabs {:.1} GB/s; whole-pool copy+hash {:.1} GB/s",
        pairs.len(),
        gb / scattered_s,
        gb / best
    );
}
