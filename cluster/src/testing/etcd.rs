//! [`TestEtcd`]: a single-member etcd on loopback ports, for tests.

use std::path::PathBuf;

use super::{
    START_ATTEMPTS, ServerProcess, TempDir, find_binary, free_port, log_tail, tcp_exchange,
};

/// A real etcd server for one test. See the [module docs](super).
#[derive(Debug)]
pub struct TestEtcd {
    binary: PathBuf,
    dir: TempDir,
    client_port: u16,
    peer_port: u16,
    process: Option<ServerProcess>,
}

impl TestEtcd {
    /// Starts etcd on free ports and waits until it reports healthy.
    pub async fn start() -> Self {
        let binary = find_binary("etcd", "TANDEM_ETCD_BIN");
        let dir = TempDir::new("etcd");
        let mut etcd = Self {
            binary,
            dir,
            client_port: 0,
            peer_port: 0,
            process: None,
        };
        for attempt in 1..=START_ATTEMPTS {
            etcd.client_port = free_port();
            etcd.peer_port = free_port();
            if etcd.client_port == etcd.peer_port {
                continue;
            }
            match etcd.launch().await {
                Ok(()) => return etcd,
                Err(exited) if exited && attempt < START_ATTEMPTS => {
                    // Most likely a port taken between our probe and etcd's bind: new ports,
                    // new data dir (a half-initialised member cannot rejoin).
                    let _ = std::fs::remove_dir_all(etcd.data_dir());
                }
                Err(_) => break,
            }
        }
        panic!(
            "etcd did not start; its log:\n{}",
            log_tail(&etcd.log_path(), 4000)
        );
    }

    /// The client URL, e.g. `http://127.0.0.1:40123`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Whether the server process is running (not stopped).
    pub fn is_running(&self) -> bool {
        self.process.is_some()
    }

    /// Kills the server (SIGKILL). Its data stays for [`TestEtcd::restart`].
    pub fn stop(&mut self) {
        if let Some(process) = self.process.take() {
            process.kill();
        }
    }

    /// Starts the server again on the same ports with the same data, and waits until healthy.
    pub async fn restart(&mut self) {
        self.stop();
        if self.launch().await.is_err() {
            panic!(
                "etcd did not restart; its log:\n{}",
                log_tail(&self.log_path(), 4000)
            );
        }
    }

    /// Restarts with an empty data directory: every key, lease and revision is gone (a lost or
    /// replaced etcd). Nodes must register again.
    pub async fn restart_empty(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(self.data_dir());
        if self.launch().await.is_err() {
            panic!(
                "etcd did not restart empty; its log:\n{}",
                log_tail(&self.log_path(), 4000)
            );
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path.join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path.join("etcd.log")
    }

    /// Starts the process; Err(true) if it exited before answering, Err(false) on timeout.
    async fn launch(&mut self) -> Result<(), bool> {
        let client_url = format!("http://127.0.0.1:{}", self.client_port);
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let args = [
            "--name=tandem-test".to_string(),
            format!("--data-dir={}", self.data_dir().display()),
            format!("--listen-client-urls={client_url}"),
            format!("--advertise-client-urls={client_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=tandem-test={peer_url}"),
            "--initial-cluster-state=new".to_string(),
            "--logger=zap".to_string(),
            "--log-outputs=stderr".to_string(),
        ];
        let mut process = ServerProcess::spawn(&self.binary, &args, &self.log_path());
        let port = self.client_port;
        let ready = process
            .wait_ready(|| async move {
                let request = b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
                tcp_exchange(port, request, true)
                    .await
                    .is_some_and(|answer| answer.contains("\"health\":\"true\""))
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

impl Drop for TestEtcd {
    fn drop(&mut self) {
        self.stop();
    }
}
