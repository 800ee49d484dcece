//! tandem's CUDA kernels: CUDA C sources compiled at run time by NVRTC, cached as PTX on disk,
//! loaded and launched through cudarc. The crate always builds: cudarc loads the driver, NVRTC,
//! cuBLAS and NCCL with `dlopen` when first used, so no CUDA toolkit is needed to compile it,
//! and every entry point checks for the library it needs first ([`libs::require`]) and returns
//! a typed [`CudaError`] instead of cudarc's panic.
//!
//! | module | what |
//! |---|---|
//! | [`error`] | [`CudaError`], the crate's one error enum |
//! | [`libs`] | is a CUDA library loadable, and which names were tried |
//! | [`device`] | [`CudaDevice::open`]: context, stream, name, compute capability, memory; checked allocation |
//! | [`ptx`] | NVRTC compile for an [`Arch`], and the on-disk [`PtxCache`] |
//! | [`launch`] | grid, block and shared-memory sizes of every kernel, as pure functions |
//! | [`buffers`] | the device KV pool and its per-layer [`KvGeom`], the RoPE table, the decode workspace |
//! | [`kernels`] | [`CudaKernels`]: the loaded module's functions, one typed launch wrapper per kernel |
//! | [`gemm`] | [`Gemm`]: the linear layers on cuBLAS (f32 sgemm; bf16 in, f32 accumulate and out) |
//! | [`graph`] | [`DeviceGraph`]: kernels captured from the stream once, replayed with one launch |
//! | [`ipc`] | a KV pool another process on the GPU opens by CUDA IPC: copies into it and XXH3 slab checksums on the device |
//! | [`staging`] | KV byte ranges between the device pool and page-locked host memory ([`PinnedHost`], [`StreamMark`]) |
//! | `src/cu/*.cu` | the CUDA C sources ([`SOURCES`]); each header states the layout it assumes |
//!
//! # Invariants
//! - Nothing here is a CPU stand-in: a function that says CUDA runs on a GPU or fails with a
//!   typed error. The CPU kernels live in `tandem-kernels`; the GPU tests compare against them.
//! - Kernels read and write the KV pool in `tandem-kv-layout`'s byte layout (layer-major slabs,
//!   `[K | V]` per slab, `[token][dim]` tiles per head), so KV blocks move between the CPU and
//!   GPU pools, and between nodes, as bytes. Int8 KV is CPU-only for now ([`CudaError::Unsupported`]).
//! - Every kernel source is compiled with the same options ([`ptx::NVRTC_OPTIONS`]:
//!   `--fmad=false`), so products and sums are rounded where the CPU kernels round them;
//!   reductions (RMSNorm, softmax, attention) are summed in a different order than the CPU's
//!   16-lane trees, so GPU and CPU agree within stated tolerances, not bit for bit. RoPE, the
//!   KV write, SiLU-mul, residual add, argmax and the conversions perform the CPU's operations
//!   exactly.
//! - One [`CudaDevice`] owns one stream; every wrapper queues on it, in order. The one other
//!   stream is a transfer path's ([`KvDeviceAccess`]): it reads or writes only KV blocks the
//!   engine is not using (pushed, or reserved and not yet adopted), ordered after the engine's
//!   work by the host (see [`ipc`]).
//!
//! # Environment
//! - `TANDEM_PTX_CACHE`: PTX cache directory ([`ptx::default_dir`] for the fallbacks).
//! - `LD_LIBRARY_PATH`: where the dynamic loader (and so cudarc) finds `libnvrtc.so.13`,
//!   `libcuda.so.1`, `libcublas.so.13`. There is no `CUDA_PATH` lookup.

pub mod buffers;
pub mod device;
pub mod error;
pub mod gemm;
pub mod graph;
pub mod ipc;
pub mod kernels;
pub mod launch;
pub mod libs;
pub mod ptx;
pub mod staging;

pub use device::{CudaDevice, device_count};
pub use error::{CudaError, CudaLib};
pub use buffers::{DecodeWorkspace, DeviceKvPool, DeviceRopeTable, KvGeom, SampleRow};
pub use gemm::{Gemm, Out};
pub use graph::DeviceGraph;
pub use ipc::{KvDeviceAccess, KvMemory, PeerKvMemory};
pub use kernels::CudaKernels;
pub use ptx::{Arch, CacheOutcome, PtxCache};
pub use staging::{PinnedHost, StreamMark};

/// The oldest compute capability the kernels support (Ampere: `cp.async`-era shared memory
/// sizes, bf16 arithmetic). The kernels target sm_90 and are compiled for the device's arch.
pub const MIN_COMPUTE_CAPABILITY: (u32, u32) = (8, 0);

/// Names of the environment variables this crate reads, in one place.
pub mod env {
    /// Directory of the PTX cache.
    pub const TANDEM_PTX_CACHE: &str = "TANDEM_PTX_CACHE";
    /// The XDG cache root (PTX cache fallback: `$XDG_CACHE_HOME/tandem/ptx`).
    pub const XDG_CACHE_HOME: &str = "XDG_CACHE_HOME";
    /// Home directory (PTX cache fallback: `$HOME/.cache/tandem/ptx`).
    pub const HOME: &str = "HOME";
    /// The dynamic loader's search path (read only to report it in errors).
    pub const LD_LIBRARY_PATH: &str = "LD_LIBRARY_PATH";
}

/// Code shared by every source (types, conversions, `exp`, reductions, KV addressing),
/// prepended to each before compiling.
pub const PRELUDE: &str = include_str!("cu/common.cuh");

/// One CUDA C source file and the kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name (also the NVRTC program name and the cache file's stem).
    pub name: &'static str,
    /// The file's text, without the prelude.
    pub body: &'static str,
    /// The `extern "C" __global__` functions it defines.
    pub functions: &'static [&'static str],
}

impl KernelSource {
    /// The text NVRTC compiles: the prelude, then the body with its own line numbers (a
    /// `#line` directive, so compiler diagnostics name `norm.cu:12`, not a prelude offset).
    pub fn full_text(&self) -> String {
        format!("{PRELUDE}\n#line 1 \"{}\"\n{}", self.name, self.body)
    }
}

/// Every kernel source of the crate.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "norm.cu",
        body: include_str!("cu/norm.cu"),
        functions: &["rms_norm_f32"],
    },
    KernelSource {
        name: "act.cu",
        body: include_str!("cu/act.cu"),
        functions: &[
            "silu_mul_f32",
            "add_inplace_f32",
            "embed_f32",
            "embed_bf16",
            "f32_to_bf16",
            "bf16_to_f32",
        ],
    },
    KernelSource {
        name: "argmax.cu",
        body: include_str!("cu/argmax.cu"),
        functions: &["argmax_f32"],
    },
    KernelSource {
        name: "sample.cu",
        body: SAMPLE_SOURCE,
        functions: &["sample_rows"],
    },
    KernelSource {
        name: "rope_kv.cu",
        body: include_str!("cu/rope_kv.cu"),
        functions: &[
            "rope_write_kv_f32",
            "rope_write_kv_f16",
            "rope_write_kv_bf16",
        ],
    },
    KernelSource {
        name: "attention.cu",
        body: include_str!("cu/attention.cu"),
        functions: &[
            "paged_attn_decode_f32",
            "paged_attn_decode_f16",
            "paged_attn_decode_bf16",
            "paged_attn_decode_reduce",
            "paged_attn_prefill_f32",
            "paged_attn_prefill_f16",
            "paged_attn_prefill_bf16",
        ],
    },
    KernelSource {
        name: "hash.cu",
        body: HASH_SOURCE,
        functions: &["xxh3_64_slabs"],
    },
];

/// `sample.cu`: temperature / top-k / top-p sampling on the device, token for token what
/// tandem-kernels `sample::sample` picks. Also run by the host's C++ compiler in the suite (a
/// thread block emulated by threads and a barrier), against the CPU's sampler.
pub const SAMPLE_SOURCE: &str = include_str!("cu/sample.cu");

/// `hash.cu`: XXH3-64 of KV slabs on the device (the checksums of the CUDA IPC path). Also
/// compiled by the host's C++ compiler in the suite, against the CPU's XXH3.
pub const HASH_SOURCE: &str = include_str!("cu/hash.cu");
