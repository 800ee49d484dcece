//! `tandem up` as a child process for tests: start it on free ports, read its stderr, find
//! the pids it wrote to `<run-dir>/pids`, signal it, and check nothing is left behind.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

/// One `tandem up` at a time per test binary (2-core machines).
pub static SERIAL: Mutex<()> = Mutex::new(());

/// How long the children may take to go once `tandem up` is told to stop or dies (each node
/// drains; a node whose etcd is gone gives up deregistering after its own timeout).
pub const GONE_WITHIN: Duration = Duration::from_secs(90);

pub fn free_addr() -> String {
    tandem_cli::ports::free_loopback_addr().unwrap().to_string()
}

pub struct Up {
    pub child: Child,
    pub run_dir: PathBuf,
    stderr: Receiver<String>,
    seen: Vec<String>,
}

impl Up {
    /// Starts `tandem up` on free ports with `extra` flags.
    pub fn start(extra: &[&str]) -> Up {
        Self::start_with(&free_addr(), &free_addr(), extra)
    }

    /// Starts `tandem up` with gRPC on `grpc`, HTTP on `http` and `extra` flags.
    pub fn start_with(grpc: &str, http: &str, extra: &[&str]) -> Up {
        let run_dir = std::env::temp_dir().join(format!(
            "tandem-up-hygiene-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["up", "--grpc", grpc, "--http", http, "--run-dir"])
            .arg(&run_dir)
            .args(extra)
            .env("TANDEM_MODEL", super::model())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start tandem up");
        let (tx, rx) = channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Up {
            child,
            run_dir,
            stderr: rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a stderr line containing `needle`.
    pub fn wait_for_line(&mut self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            match self.stderr.recv_timeout(Duration::from_millis(200)) {
                Ok(line) => {
                    let hit = line.contains(needle);
                    self.seen.push(line);
                    if hit {
                        return;
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        panic!(
            "tandem up never printed {needle:?}; its stderr:\n{}",
            self.seen.join("\n")
        );
    }

    /// The first stderr line seen so far that contains `needle`.
    pub fn line_with(&self, needle: &str) -> Option<String> {
        self.seen.iter().find(|l| l.contains(needle)).cloned()
    }

    /// Reads what `tandem up` printed since the last call (without waiting).
    pub fn drain_stderr(&mut self) -> String {
        while let Ok(l) = self.stderr.try_recv() {
            self.seen.push(l);
        }
        self.seen.join("\n")
    }

    /// The address printed after `label` in the "is serving" summary (`etcd`, `NATS`).
    pub fn printed(&self, label: &str) -> String {
        let line = self
            .line_with(&format!("  {label}  "))
            .unwrap_or_else(|| panic!("no `{label}` line; stderr:\n{}", self.seen.join("\n")));
        line.split_whitespace().nth(1).unwrap().to_string()
    }

    /// `(name, pid)` of every child `tandem up` started so far.
    pub fn pids(&self) -> Vec<(String, i32)> {
        std::fs::read_to_string(self.run_dir.join("pids"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (name, pid) = l.split_once(' ').expect("`name pid` lines");
                (name.to_string(), pid.parse().expect("a pid"))
            })
            .collect()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own unreaped child.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    /// Waits for `tandem up` to exit; returns its exit code and the rest of its stderr.
    pub fn wait_exit(&mut self, within: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                while let Ok(l) = self.stderr.recv_timeout(Duration::from_millis(500)) {
                    self.seen.push(l);
                }
                return (status.code(), self.seen.join("\n"));
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "tandem up did not exit within {within:?}; stderr:\n{}",
                    self.seen.join("\n")
                );
            }
            while let Ok(l) = self.stderr.try_recv() {
                self.seen.push(l);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        // A failed assertion must not leave a cluster behind for the next test.
        let _ = self.child.kill();
        let _ = self.child.wait();
        for (_, pid) in self.pids() {
            // SAFETY: kill(2); at worst the pid is already gone.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

/// Whether `pid` is still a running process (a zombie waiting for a reaper counts as gone:
/// it holds no ports, memory or KV blocks).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")) {
        Err(_) => false,
        Ok(stat) => {
            // Field 3, after the parenthesised command name.
            let state = stat.rsplit_once(')').map(|(_, r)| r.trim_start().chars().next());
            !matches!(state, Some(Some('Z' | 'X')))
        }
    }
}

/// Waits until none of `pids` runs; fails naming the ones left.
pub fn assert_all_gone(pids: &[(String, i32)], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let left: Vec<_> = pids.iter().filter(|(_, p)| alive(*p)).collect();
        if left.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            panic!("processes left behind after {within:?}: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

