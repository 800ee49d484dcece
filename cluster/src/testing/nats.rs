//! [`TestNats`]: a core NATS server (no JetStream) on a loopback port, for tests.

use std::path::PathBuf;

use super::{
    START_ATTEMPTS, ServerProcess, TempDir, find_binary, free_port, log_tail, tcp_exchange,
};

/// A real NATS server for one test. See the [module docs](super).
#[derive(Debug)]
pub struct TestNats {
    binary: PathBuf,
    dir: TempDir,
    port: u16,
    process: Option<ServerProcess>,
}

impl TestNats {
    /// Starts nats-server on a free port and waits until it greets clients.
    pub async fn start() -> Self {
        let binary = find_binary("nats-server", "TANDEM_NATS_SERVER_BIN");
        let dir = TempDir::new("nats");
        let mut nats = Self {
            binary,
            dir,
            port: 0,
            process: None,
        };
        for attempt in 1..=START_ATTEMPTS {
            nats.port = free_port();
            match nats.launch().await {
                Ok(()) => return nats,
                Err(exited) if exited && attempt < START_ATTEMPTS => continue,
                Err(_) => break,
            }
        }
        panic!(
            "nats-server did not start; its log:\n{}",
            log_tail(&nats.log_path(), 4000)
        );
    }

    /// The client URL, e.g. `nats://127.0.0.1:40123`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Whether the server process is running (not stopped).
    pub fn is_running(&self) -> bool {
        self.process.is_some()
    }

    /// Kills the server (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(process) = self.process.take() {
            process.kill();
        }
    }

    /// Starts the server again on the same port and waits until it greets clients.
    pub async fn restart(&mut self) {
        self.stop();
        if self.launch().await.is_err() {
            panic!(
                "nats-server did not restart; its log:\n{}",
                log_tail(&self.log_path(), 4000)
            );
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path.join("nats.log")
    }

    async fn launch(&mut self) -> Result<(), bool> {
        let args = [
            "--addr=127.0.0.1".to_string(),
            format!("--port={}", self.port),
            format!("--pid={}", self.dir.path.join("nats.pid").display()),
        ];
        let mut process = ServerProcess::spawn(&self.binary, &args, &self.log_path());
        let port = self.port;
        let ready = process
            .wait_ready(|| async move {
                tcp_exchange(port, b"", false)
                    .await
                    .is_some_and(|greeting| greeting.starts_with("INFO "))
            })
            .await;
        match ready {
            Ok(()) => {
                self.process = Some(process);
                Ok(())
            }
            Err(exited) => {
                process.kill();
                Err(exited)
            }
        }
    }
}

impl Drop for TestNats {
    fn drop(&mut self) {
        self.stop();
    }
}
