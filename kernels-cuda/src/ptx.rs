//! Compiling CUDA C with NVRTC, and the on-disk PTX cache.
//!
//! [`compile`] runs NVRTC (through cudarc's `nvrtc::result` layer, which also hands back the
//! compiler's log when the compile *succeeds*, so warnings are visible) for one [`Arch`].
//! [`PtxCache::get_or_compile`] puts a file cache in front of it.
//!
//! # Cache invariants
//! - Key: SHA-256 of (format version, the full source text, the NVRTC options, the target
//!   arch, the NVRTC version). The file name repeats the source name, the arch and the NVRTC
//!   version for people (`attention.sm_90.nvrtc13.0.<hash>.ptx`); the hash alone decides.
//!   The NVRTC version is in the key because PTX from a newer NVRTC can carry a PTX ISA version
//!   that an older driver refuses.
//! - Each file is `// tandem-ptx sha256=<hex of the PTX that follows>\n` + the PTX (a PTX
//!   comment, so the file is itself loadable PTX). A file whose header is missing or does not
//!   match its body (truncated, corrupted, hand-edited) is recompiled and rewritten, with one
//!   `warn!`.
//! - Writes are atomic: a temporary file in the same directory, then `rename`. Concurrent
//!   processes compiling the same key write the same bytes; the last rename wins.
//! - A cache directory that cannot be written costs a `warn!` and a compile on every start, never
//!   an error: the PTX is still returned.
//!
//! Directory: `TANDEM_PTX_CACHE`, else `$XDG_CACHE_HOME/tandem/ptx`, else
//! `$HOME/.cache/tandem/ptx`, else `<temp dir>/tandem-ptx`.

use crate::error::{CudaError, CudaLib};
use crate::{env, libs};
use cudarc::nvrtc::result as nvrtc;
use sha2::{Digest, Sha256};
use std::ffi::{CStr, CString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bump when the file format or the key's ingredients change.
const FORMAT: &str = "tandem-ptx-v1";
const HEADER_PREFIX: &str = "// tandem-ptx sha256=";

/// Options every kernel is compiled with (besides the arch). `--fmad=false` keeps `a*b + c`
/// two roundings, as in the CPU kernels; the sources write `fmaf` where the CPU fuses.
pub const NVRTC_OPTIONS: &[&str] = &["--fmad=false", "--std=c++17"];

/// A GPU architecture to compile for: compute capability `major.minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    /// Compute capability major (9 for Hopper).
    pub major: u32,
    /// Compute capability minor.
    pub minor: u32,
}

impl Arch {
    /// Hopper (H100, H200): the target.
    pub const SM_90: Arch = Arch { major: 9, minor: 0 };
    /// Ampere (A100): the oldest supported.
    pub const SM_80: Arch = Arch { major: 8, minor: 0 };

    /// The arch of a device with compute capability `cc`.
    pub const fn from_cc(cc: (u32, u32)) -> Arch {
        Arch {
            major: cc.0,
            minor: cc.1,
        }
    }

    /// NVRTC's virtual architecture name (`compute_90`): the PTX target.
    pub fn compute_name(&self) -> String {
        format!("compute_{}{}", self.major, self.minor)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// One compiled source.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The PTX text.
    pub ptx: String,
    /// NVRTC's log (warnings); empty for a clean compile, and for a cache hit.
    pub log: String,
}

/// The NVRTC version (major, minor) of the loaded library.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    libs::require(CudaLib::Nvrtc)?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through valid pointers; the library is present.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Nvrtc {
            op: "nvrtcVersion",
            message: format!("{e:?}"),
        })?;
    Ok((major, minor))
}

/// The full NVRTC option list for `arch`.
pub fn options(arch: Arch) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={}", arch.compute_name())];
    o.extend(NVRTC_OPTIONS.iter().map(|s| s.to_string()));
    o
}

/// Compiles `source` (named `name` in diagnostics) to PTX for `arch`. No cache.
pub fn compile(name: &str, source: &str, arch: Arch) -> Result<Compiled, CudaError> {
    libs::require(CudaLib::Nvrtc)?;
    let nv = |op: &'static str| {
        move |e: nvrtc::NvrtcError| CudaError::Nvrtc {
            op,
            message: format!("{e:?}"),
        }
    };
    let src = CString::new(source).map_err(|_| CudaError::Nvrtc {
        op: "nvrtcCreateProgram",
        message: format!("source `{name}` contains a NUL byte"),
    })?;
    let cname = CString::new(name).unwrap_or_else(|_| CString::new("kernel.cu").expect("no NUL"));
    let prog = nvrtc::create_program(&src, Some(&cname)).map_err(nv("nvrtcCreateProgram"))?;
    let prog = Program(prog);
    let opts = options(arch);
    // SAFETY: `prog` is a live program; the options are plain strings.
    let compiled = unsafe { nvrtc::compile_program(prog.0, &opts) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(prog.0) }
        .map(c_chars_to_string)
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(CudaError::Compile {
            source_name: name.to_string(),
            arch: arch.to_string(),
            nvrtc: format!("{:?}", e.0),
            log,
        });
    }
    // SAFETY: as above, after a successful compile.
    let ptx = unsafe { nvrtc::get_ptx(prog.0) }.map_err(nv("nvrtcGetPTX"))?;
    Ok(Compiled {
        ptx: c_chars_to_string(ptx),
        log,
    })
}

/// Destroys the NVRTC program on every path.
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed once.
        if let Err(e) = unsafe { nvrtc::destroy_program(self.0) } {
            tracing::warn!(?e, "nvrtcDestroyProgram failed");
        }
    }
}

fn c_chars_to_string(v: Vec<std::ffi::c_char>) -> String {
    let bytes: Vec<u8> = v.into_iter().map(|c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// How a [`PtxCache::get_or_compile`] call was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Read from the cache.
    Hit,
    /// Not in the cache: compiled and stored.
    Compiled,
    /// In the cache but unreadable or corrupt: compiled again and rewritten.
    Recompiled,
}

/// What a cached PTX is keyed by (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// SHA-256 (hex) of every ingredient.
    pub hash: String,
    /// The file name: `<name>.<arch>.nvrtc<maj>.<min>.<hash prefix>.ptx`.
    pub file_name: String,
}

impl CacheKey {
    /// The key of `source` named `name`, for `arch`, NVRTC `nvrtc` and `options`.
    pub fn new(
        name: &str,
        source: &str,
        arch: Arch,
        nvrtc: (i32, i32),
        options: &[String],
    ) -> CacheKey {
        let mut h = Sha256::new();
        for part in [
            FORMAT,
            source,
            &arch.to_string(),
            &format!("{}.{}", nvrtc.0, nvrtc.1),
        ] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        for o in options {
            h.update((o.len() as u64).to_le_bytes());
            h.update(o.as_bytes());
        }
        let hash = hex(&h.finalize());
        let stem: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let file_name = format!(
            "{stem}.{arch}.nvrtc{}.{}.{}.ptx",
            nvrtc.0,
            nvrtc.1,
            &hash[..16]
        );
        CacheKey { hash, file_name }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A directory of compiled PTX, with counters of how calls were served.
#[derive(Debug)]
pub struct PtxCache {
    dir: PathBuf,
    hits: AtomicU64,
    compiles: AtomicU64,
    recompiles: AtomicU64,
}

impl PtxCache {
    /// A cache in `dir` (created on first write).
    pub fn new(dir: impl Into<PathBuf>) -> PtxCache {
        PtxCache {
            dir: dir.into(),
            hits: AtomicU64::new(0),
            compiles: AtomicU64::new(0),
            recompiles: AtomicU64::new(0),
        }
    }

    /// The cache at [`default_dir`].
    pub fn from_env() -> PtxCache {
        PtxCache::new(default_dir())
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Calls served from disk.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Calls that ran NVRTC (fresh compiles and recompiles of bad entries).
    pub fn compiles(&self) -> u64 {
        self.compiles.load(Ordering::Relaxed) + self.recompiles.load(Ordering::Relaxed)
    }

    /// Calls that found a bad entry and recompiled it.
    pub fn recompiles(&self) -> u64 {
        self.recompiles.load(Ordering::Relaxed)
    }

    /// The path `source` named `name` has (or would have) for `arch` with the loaded NVRTC.
    pub fn path_for(&self, name: &str, source: &str, arch: Arch) -> Result<PathBuf, CudaError> {
        let key = CacheKey::new(name, source, arch, nvrtc_version()?, &options(arch));
        Ok(self.dir.join(key.file_name))
    }

    /// The PTX of `source` for `arch`: from the cache, or compiled and stored.
    pub fn get_or_compile(
        &self,
        name: &str,
        source: &str,
        arch: Arch,
    ) -> Result<(Compiled, CacheOutcome), CudaError> {
        let path = self.path_for(name, source, arch)?;
        let outcome = match std::fs::read(&path) {
            Ok(bytes) => match parse_entry(&bytes) {
                Some(ptx) => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok((
                        Compiled {
                            ptx,
                            log: String::new(),
                        },
                        CacheOutcome::Hit,
                    ));
                }
                None => {
                    tracing::warn!(path = %path.display(), "PTX cache entry is corrupt; recompiling");
                    CacheOutcome::Recompiled
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => CacheOutcome::Compiled,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "PTX cache entry is unreadable; recompiling");
                CacheOutcome::Recompiled
            }
        };
        let compiled = compile(name, source, arch)?;
        match outcome {
            CacheOutcome::Recompiled => self.recompiles.fetch_add(1, Ordering::Relaxed),
            _ => self.compiles.fetch_add(1, Ordering::Relaxed),
        };
        if let Err(e) = write_entry(&path, &compiled.ptx) {
            tracing::warn!(path = %path.display(), error = %e, "could not write the PTX cache entry");
        }
        Ok((compiled, outcome))
    }
}

/// `TANDEM_PTX_CACHE`, else `$XDG_CACHE_HOME/tandem/ptx`, else `$HOME/.cache/tandem/ptx`, else
/// `<temp dir>/tandem-ptx`.
pub fn default_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var(env::TANDEM_PTX_CACHE) {
        d
    } else if let Some(d) = var(env::XDG_CACHE_HOME) {
        d.join("tandem").join("ptx")
    } else if let Some(d) = var(env::HOME) {
        d.join(".cache").join("tandem").join("ptx")
    } else {
        std::env::temp_dir().join("tandem-ptx")
    }
}

/// The PTX of a cache file, or `None` when the header is missing or does not match the body.
fn parse_entry(bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?;
    let (header, body) = text.split_once('\n')?;
    let want = header.strip_prefix(HEADER_PREFIX)?;
    (hex(&Sha256::digest(body.as_bytes())) == want && !body.is_empty()).then(|| body.to_string())
}

fn write_entry(path: &Path, ptx: &str) -> std::io::Result<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().expect("cache files live in a directory");
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}.{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("ptx"),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let contents = format!(
        "{HEADER_PREFIX}{}\n{ptx}",
        hex(&Sha256::digest(ptx.as_bytes()))
    );
    let written = std::fs::write(&tmp, contents).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        assert_eq!(Arch::SM_90.to_string(), "sm_90");
        assert_eq!(Arch::SM_90.compute_name(), "compute_90");
        assert_eq!(Arch::from_cc((8, 6)).to_string(), "sm_86");
        assert!(Arch::SM_80 < Arch::SM_90);
    }

    #[test]
    fn key_changes_with_every_ingredient() {
        let o = options(Arch::SM_90);
        let base = CacheKey::new("a.cu", "src", Arch::SM_90, (13, 0), &o);
        assert_eq!(base, CacheKey::new("a.cu", "src", Arch::SM_90, (13, 0), &o));
        assert!(
            base.file_name.starts_with("a_cu.sm_90.nvrtc13.0."),
            "{}",
            base.file_name
        );
        let others = [
            CacheKey::new("a.cu", "src2", Arch::SM_90, (13, 0), &o),
            CacheKey::new("a.cu", "src", Arch::SM_80, (13, 0), &options(Arch::SM_80)),
            CacheKey::new("a.cu", "src", Arch::SM_90, (13, 1), &o),
            CacheKey::new(
                "a.cu",
                "src",
                Arch::SM_90,
                (13, 0),
                &["--fmad=true".to_string()],
            ),
        ];
        for k in others {
            assert_ne!(k.hash, base.hash);
            assert_ne!(k.file_name, base.file_name);
        }
    }

    #[test]
    fn entries_round_trip_and_reject_tampering() {
        let dir = std::env::temp_dir().join(format!("tandem-ptx-unit-{}", std::process::id()));
        let path = dir.join("x.ptx");
        write_entry(&path, ".version 8.0\n// body\n").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            parse_entry(&bytes).as_deref(),
            Some(".version 8.0\n// body\n")
        );
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(parse_entry(&bad), None);
        assert_eq!(parse_entry(&bytes[..bytes.len() / 2]), None);
        assert_eq!(parse_entry(b"garbage"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
