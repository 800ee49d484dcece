//! Real etcd and NATS servers for tests: [`TestEtcd`] and [`TestNats`] (also used by other
//! crates' tests, so this module is always built; it costs nothing unless called).
//!
//! Each server runs the installed binary on free loopback ports (bind port 0, read the port,
//! release it, start the server; retry on the rare collision), keeps its data and log in a
//! fresh temporary directory, and is waited on until it answers (polling with a deadline, no
//! fixed sleeps). `stop()` kills it (SIGKILL: an outage, not a graceful shutdown), `restart()`
//! brings it back on the same port; dropping the handle kills it and removes the directory.
//!
//! A missing binary is a panic with the install command, never a skipped test. The binaries
//! are looked up in `$TANDEM_ETCD_BIN` / `$TANDEM_NATS_SERVER_BIN`, then `$PATH`, then the
//! Debian locations (`/usr/bin`, `/usr/sbin`).
//!
//! These helpers panic on failure, like assertions: they are for tests only.

mod etcd;
mod nats;

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use etcd::TestEtcd;
pub use nats::TestNats;

/// How long a server may take to answer after it is started.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How often readiness is polled.
const READY_POLL: Duration = Duration::from_millis(25);
/// Fresh ports tried before giving up on starting a server.
const START_ATTEMPTS: u32 = 5;

const INSTALL_HINT: &str = "install the servers with `apt-get install etcd-server nats-server` \
    (Debian/Ubuntu), or point TANDEM_ETCD_BIN / TANDEM_NATS_SERVER_BIN at the binaries";

/// Finds an installed server binary or panics with the install hint.
fn find_binary(name: &str, env_var: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(env_var) {
        return PathBuf::from(path);
    }
    let path_dirs = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    let fallbacks =
        ["/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin"].map(PathBuf::from);
    path_dirs
        .into_iter()
        .chain(fallbacks)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| panic!("`{name}` not found in $PATH or /usr/(s)bin: {INSTALL_HINT}"))
}

/// A port that was free a moment ago (the caller starts a server on it and retries if lost).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("binding 127.0.0.1:0 must work for tests")
}

/// A temporary directory removed on drop.
#[derive(Debug)]
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn new(what: &str) -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!(
            "tandem-test-{what}-{}-{nanos}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        Self { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// One run of a server binary, with its output appended to a log file.
#[derive(Debug)]
struct ServerProcess {
    child: Child,
}

impl ServerProcess {
    fn spawn(binary: &Path, args: &[String], log: &Path) -> Self {
        let log_file = || {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .unwrap_or_else(|e| panic!("cannot open {}: {e}", log.display()))
        };
        let child = Command::new(binary)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log_file())
            .stderr(log_file())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}; {INSTALL_HINT}", binary.display()));
        Self { child }
    }

    /// Polls `probe` until it answers true. Err(true) if the process exited first (e.g. its
    /// port was taken), Err(false) on timeout.
    async fn wait_ready<F, Fut>(&mut self, probe: F) -> Result<(), bool>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return Err(true);
            }
            if tokio::time::timeout(Duration::from_secs(1), probe()).await == Ok(true) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(false);
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// SIGKILL and reap.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last `max_bytes` of a log file, for panic messages.
fn log_tail(path: &Path, max_bytes: u64) -> String {
    let Ok(mut file) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max_bytes)));
    let mut tail = String::new();
    let _ = file.read_to_string(&mut tail);
    tail
}

/// Sends `request` to 127.0.0.1:`port` and returns the whole answer (for HTTP/1.0 probes and
/// NATS's INFO line); None on any error.
async fn tcp_exchange(port: u16, request: &[u8], read_until_close: bool) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    if !request.is_empty() {
        stream.write_all(request).await.ok()?;
    }
    let mut buf = Vec::new();
    if read_until_close {
        stream.read_to_end(&mut buf).await.ok()?;
    } else {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await.ok()?;
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}
