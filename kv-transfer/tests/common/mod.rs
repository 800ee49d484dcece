//! Shared test harness: a sender and a receiver joined by one transport.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use tandem_kv_layout::{KvDtype, KvLayout};
use tandem_kv_transfer::device::HostDeviceKv;
use tandem_kv_transfer::pattern;
use tandem_kv_transfer::{
    InProcKvTransport, InProcNetwork, InboundRegistry, KvPool, KvTransport, PoolRegistration,
    TcpKvTransport, TransferConfig, TransferMetrics,
};
use tokio_util::sync::CancellationToken;

pub mod scenarios;

/// One `#[tokio::test]` per scenario in [`scenarios`], for a transport: `$make` turns (source
/// layout, destination layout) into a future of a [`Pair`].
#[allow(unused_macros)] // not every test crate runs the scenarios
macro_rules! scenario_tests {
    ($make:expr) => {
        scenario_tests!(@same $make;
            every_layer_of_every_block_arrives_intact,
            streamed_layers_complete_only_when_the_last_layer_lands,
            unknown_stale_and_expired_reservations_are_refused_without_writing,
            a_corrupted_byte_is_always_detected_and_never_marked_ready,
            sender_cancel_ends_both_sides_and_releases_everything,
            receiver_cancel_ends_both_sides_and_releases_everything,
            reservation_expiry_mid_transfer_ends_both_sides,
            a_dropped_chunk_ends_in_a_deadline_error_and_no_leak,
            delayed_chunks_still_arrive_intact,
            a_cut_connection_ends_both_sides_and_the_next_push_reconnects
        );

        #[tokio::test]
        async fn layout_mismatch_is_refused_before_any_byte_is_written() {
            let small = crate::common::small_layout();
            let other = tandem_kv_layout::KvLayout { model_fingerprint: 1, ..small };
            let pair = ($make)(small, other).await;
            crate::common::scenarios::layout_mismatch_is_refused_before_any_byte_is_written(&pair)
                .await;
        }
    };
    (@same $make:expr; $($name:ident),*) => {
        $(
            #[tokio::test]
            async fn $name() {
                let small = crate::common::small_layout();
                let pair = ($make)(small, small).await;
                crate::common::scenarios::$name(&pair).await;
            }
        )*
    };
}

pub const SEED: u64 = 0x7a11_d0e5;
pub const BLOCKS: usize = 16;

/// A small layout: 4 layers × 2 heads × 16 dims × 4 tokens, f16 (512-byte slabs).
pub fn small_layout() -> KvLayout {
    KvLayout::new(4, 2, 16, 4, KvDtype::F16, 0x5eed).unwrap()
}

pub fn source_pool(layout: KvLayout, blocks: usize) -> Arc<KvPool> {
    let mut pool = KvPool::new(layout, blocks).unwrap();
    let ids: Vec<u32> = (0..blocks as u32).collect();
    pattern::fill_blocks(&mut pool, SEED, &ids).unwrap();
    Arc::new(pool)
}

pub struct Pair {
    pub sender: Arc<dyn KvTransport>,
    pub sender_metrics: Arc<TransferMetrics>,
    pub src: PoolRegistration,
    pub registry: InboundRegistry,
    pub receiver_metrics: Arc<TransferMetrics>,
    pub peer: String,
    pub shutdown: CancellationToken,
    /// Keeps the receiving transport (and its UCX thread) alive.
    pub _receiver: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// The receiver's device pool, where data-path bytes land (CUDA IPC pairs).
    pub landing: Option<Arc<HostDeviceKv>>,
}

impl Pair {
    /// The receiver's KV as a pool: its registered pool, or (CUDA IPC pairs) a copy of the
    /// device pool the bytes land in.
    fn landed(&self) -> Arc<KvPool> {
        let host = self.registry.registration().pool();
        let Some(device) = &self.landing else {
            return Arc::clone(host);
        };
        let pool = KvPool::new(*host.layout(), host.num_blocks()).unwrap();
        let bytes = device.read(0, pool.len_bytes());
        // SAFETY: a fresh pool of exactly that many bytes, not shared yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), pool.as_ptr(), bytes.len()) };
        Arc::new(pool)
    }

    /// Bytes of every destination slab that are not zero (to prove nothing was written).
    pub fn dst_nonzero_bytes(&self) -> usize {
        let pool = &self.landed();
        let mut n = 0;
        for layer in 0..pool.layout().num_layers {
            for b in 0..pool.num_blocks() as u32 {
                // SAFETY: tests call this only when no transfer is in flight.
                n += unsafe { pool.slab(layer, b) }
                    .unwrap()
                    .iter()
                    .filter(|&&x| x != 0)
                    .count();
            }
        }
        n
    }

    /// Slabs of `dst` that do not hold `src`'s pattern.
    pub fn mismatched(&self, src: &[u32], dst: &[u32]) -> usize {
        // SAFETY: called after the reservation resolved.
        unsafe { pattern::mismatched_slabs(&self.landed(), SEED, src, dst) }.unwrap()
    }

    /// Waits until neither side holds anything (registrations aside), or panics.
    pub async fn assert_released(&self) {
        wait_for(
            "sender and receiver to release transfers and reservations",
            || {
                let s = self.sender_metrics.snapshot();
                let r = self.receiver_metrics.snapshot();
                s.live_transfers == 0
                    && r.live_reservations == 0
                    && self.registry.live_reservations() == 0
            },
        )
        .await;
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

pub fn fence() -> Duration {
    Duration::from_millis(500)
}

pub fn inproc_pair(src_layout: KvLayout, dst_layout: KvLayout) -> Pair {
    let net = InProcNetwork::new();
    let sender = InProcKvTransport::new(net.clone(), 1 << 20);
    let receiver = InProcKvTransport::new(net.clone(), 1 << 20);
    let src = sender.register(source_pool(src_layout, BLOCKS)).unwrap();
    let dst = receiver
        .register(Arc::new(KvPool::new(dst_layout, BLOCKS).unwrap()))
        .unwrap();
    let registry = InboundRegistry::new(dst, fence());
    net.attach("decode-0", registry.clone());
    Pair {
        sender_metrics: Arc::clone(sender.metrics()),
        receiver_metrics: Arc::clone(receiver.metrics()),
        sender: Arc::new(sender),
        src,
        registry,
        peer: "decode-0".into(),
        shutdown: CancellationToken::new(),
        _receiver: None,
        landing: None,
    }
}

pub fn small_chunks() -> TransferConfig {
    // One layer per chunk for the small layout (16 blocks × 512 B = 8 KiB per layer).
    TransferConfig {
        max_chunk_bytes: 8 << 10,
        fence_timeout: fence(),
        ..Default::default()
    }
}

pub async fn tcp_pair(src_layout: KvLayout, dst_layout: KvLayout) -> Pair {
    tcp_pair_with_stall_timeout(src_layout, dst_layout, None).await
}

/// A TCP pair whose receiver ends a claimed push that lands nothing for `stall`.
pub async fn tcp_pair_with_stall_timeout(
    src_layout: KvLayout,
    dst_layout: KvLayout,
    stall: Option<Duration>,
) -> Pair {
    let sender = TcpKvTransport::new(small_chunks()).unwrap();
    let receiver = Arc::new(TcpKvTransport::new(small_chunks()).unwrap());
    let src = sender.register(source_pool(src_layout, BLOCKS)).unwrap();
    let dst = receiver
        .register(Arc::new(KvPool::new(dst_layout, BLOCKS).unwrap()))
        .unwrap();
    serve_tcp(sender, receiver, src, dst, stall, None).await
}

/// Starts `receiver` serving `dst` on a loopback port and joins it with `sender` (pushing from
/// `src`) into a [`Pair`].
async fn serve_tcp(
    sender: TcpKvTransport,
    receiver: Arc<TcpKvTransport>,
    src: PoolRegistration,
    dst: PoolRegistration,
    stall: Option<Duration>,
    landing: Option<Arc<HostDeviceKv>>,
) -> Pair {
    let registry = InboundRegistry::with_stall_timeout(dst, fence(), stall);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer = listener.local_addr().unwrap().to_string();
    let shutdown = CancellationToken::new();
    let (r, reg, sd) = (Arc::clone(&receiver), registry.clone(), shutdown.clone());
    tokio::spawn(async move { r.serve(listener, reg, sd).await.unwrap() });
    Pair {
        sender_metrics: Arc::clone(sender.metrics()),
        receiver_metrics: Arc::clone(receiver.metrics()),
        sender: Arc::new(sender),
        src,
        registry,
        peer,
        shutdown,
        _receiver: Some(receiver),
        landing,
    }
}

/// Two TCP transports in one process joined by the CUDA IPC data path over host stand-ins for
/// device pools ([`HostDeviceKv`]) "on" GPUs `src_gpu` and `dst_gpu`: the sender's device pool
/// holds the source pattern; bytes land in the receiver's device pool when the GPUs are the
/// same, in its registered host pool (the stream) when they differ.
pub async fn ipc_pair_on(
    src_layout: KvLayout,
    dst_layout: KvLayout,
    src_gpu: u8,
    dst_gpu: u8,
) -> Pair {
    ipc_pair_with(src_layout, dst_layout, src_gpu, dst_gpu, 0).await
}

/// Both on one GPU, but the receiver's device pool is `extra_bytes` larger than its registered
/// host pool (not its mirror): it must decline IPC, so the sender streams from its mirror.
pub async fn ipc_pair_mismatched_mirror(layout: KvLayout, extra_bytes: usize) -> Pair {
    ipc_pair_with(layout, layout, 4, 4, extra_bytes).await
}

async fn ipc_pair_with(
    src_layout: KvLayout,
    dst_layout: KvLayout,
    src_gpu: u8,
    dst_gpu: u8,
    extra_bytes: usize,
) -> Pair {
    let ipc = src_gpu == dst_gpu && extra_bytes == 0;
    let sender = TcpKvTransport::new(small_chunks()).unwrap();
    let receiver = Arc::new(TcpKvTransport::new(small_chunks()).unwrap());
    let source = source_pool(src_layout, BLOCKS);
    let src_device = Arc::new(HostDeviceKv::new([src_gpu; 16], source.len_bytes()));
    // SAFETY: nothing else touches the fresh source pool.
    src_device.write(0, unsafe {
        std::slice::from_raw_parts(source.as_ptr(), source.len_bytes())
    });
    sender.attach_device(src_device).unwrap();
    // On one GPU the bytes must come from the device pool: the host mirror is left zero, so a
    // path that read it would fail every content check.
    let mirror = if ipc {
        Arc::new(KvPool::new(src_layout, BLOCKS).unwrap())
    } else {
        source
    };
    let src = sender.register(mirror).unwrap();
    let dst_pool = Arc::new(KvPool::new(dst_layout, BLOCKS).unwrap());
    let dst_device = Arc::new(HostDeviceKv::new(
        [dst_gpu; 16],
        dst_pool.len_bytes() + extra_bytes,
    ));
    receiver
        .attach_device(Arc::clone(&dst_device) as Arc<dyn tandem_kv_transfer::device::DeviceKv>)
        .unwrap();
    let dst = receiver.register(dst_pool).unwrap();
    let landing = ipc.then_some(dst_device);
    serve_tcp(sender, receiver, src, dst, None, landing).await
}

/// [`ipc_pair_on`] with both pools on one GPU.
pub async fn ipc_pair(src_layout: KvLayout, dst_layout: KvLayout) -> Pair {
    ipc_pair_on(src_layout, dst_layout, 3, 3).await
}

/// Two UCX transports in one process. With `allocated`, both pools come from
/// `KvTransport::allocate` (UCX-allocated shared memory: the sender writes through its mapping
/// of the receiver's pool); otherwise they are heap pools registered with `register` (UCX puts).
#[cfg(feature = "ucx")]
pub async fn ucx_pair(
    src_layout: KvLayout,
    dst_layout: KvLayout,
    tls: &str,
    allocated: bool,
) -> Pair {
    ucx_pair_with(src_layout, dst_layout, tls, allocated, small_chunks()).await
}

/// [`ucx_pair`] with the sender's and receiver's `config`.
#[cfg(feature = "ucx")]
pub async fn ucx_pair_with(
    src_layout: KvLayout,
    dst_layout: KvLayout,
    tls: &str,
    allocated: bool,
    config: TransferConfig,
) -> Pair {
    use tandem_kv_transfer::{UcxConfig, UcxKvTransport};
    let cfg = UcxConfig {
        tls: Some(tls.to_string()),
        ..Default::default()
    };
    let sender = UcxKvTransport::new(config.clone(), cfg.clone()).unwrap();
    let receiver = Arc::new(UcxKvTransport::new(config, cfg).unwrap());
    let (src, dst) = if allocated {
        let src = sender.allocate(src_layout, BLOCKS).unwrap();
        let ids: Vec<u32> = (0..BLOCKS as u32).collect();
        // SAFETY: the pool was just allocated; nothing else touches it.
        unsafe { pattern::fill_blocks_shared(src.pool(), SEED, &ids) }.unwrap();
        (src, receiver.allocate(dst_layout, BLOCKS).unwrap())
    } else {
        let src = sender.register(source_pool(src_layout, BLOCKS)).unwrap();
        let dst = receiver
            .register(Arc::new(KvPool::new(dst_layout, BLOCKS).unwrap()))
            .unwrap();
        (src, dst)
    };
    let registry = InboundRegistry::new(dst, fence());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer = listener.local_addr().unwrap().to_string();
    let shutdown = CancellationToken::new();
    let (r, reg, sd) = (Arc::clone(&receiver), registry.clone(), shutdown.clone());
    tokio::spawn(async move { r.serve(listener, reg, sd).await.unwrap() });
    Pair {
        sender_metrics: Arc::clone(sender.metrics()),
        receiver_metrics: Arc::clone(receiver.metrics()),
        sender: Arc::new(sender),
        src,
        registry,
        peer,
        shutdown,
        _receiver: Some(receiver),
        landing: None,
    }
}
