//! `tandem up` leaves no process behind, however it ends: SIGTERM while the nodes are still
//! loading, SIGINT while the sample answer streams, and SIGKILL of `tandem up` itself (the
//! children's parent-death signal). Each test reads the pids `tandem up` wrote to
//! `<run-dir>/pids` and checks every one is gone. Real etcd, NATS and nodes; one at a time.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// How long the children may take to go once `tandem up` is told to stop or dies (each node
/// drains; a node whose etcd is gone gives up deregistering after its own timeout).
const GONE_WITHIN: Duration = Duration::from_secs(90);

fn free_addr() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string()
}

struct Up {
    child: Child,
    run_dir: PathBuf,
    stderr: Receiver<String>,
    seen: Vec<String>,
}

impl Up {
    fn start(extra: &[&str]) -> Up {
        let run_dir = std::env::temp_dir().join(format!(
            "tandem-up-hygiene-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["up", "--grpc", &free_addr(), "--http", &free_addr(), "--run-dir"])
            .arg(&run_dir)
            .args(extra)
            .env("TANDEM_MODEL", common::model())
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
    fn wait_for_line(&mut self, needle: &str, within: Duration) {
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

    /// `(name, pid)` of every child `tandem up` started so far.
    fn pids(&self) -> Vec<(String, i32)> {
        std::fs::read_to_string(self.run_dir.join("pids"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (name, pid) = l.split_once(' ').expect("`name pid` lines");
                (name.to_string(), pid.parse().expect("a pid"))
            })
            .collect()
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own unreaped child.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    /// Waits for `tandem up` to exit; returns its exit code and the rest of its stderr.
    fn wait_exit(&mut self, within: Duration) -> (Option<i32>, String) {
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
fn alive(pid: i32) -> bool {
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
fn assert_all_gone(pids: &[(String, i32)], within: Duration) {
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

#[test]
fn sigterm_while_nodes_load_stops_every_process_started() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut up = Up::start(&["--no-sample"]);
    // Every process is started (the router is the last) but the nodes are still loading.
    up.wait_for_line("waiting for 1 decode and 1 prefill", Duration::from_secs(60));
    let pids = up.pids();
    let names: Vec<&str> = pids.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["etcd", "nats", "decode-0", "prefill-0", "router"]);
    up.signal(libc::SIGTERM);
    let (code, err) = up.wait_exit(GONE_WITHIN);
    assert_ne!(code, Some(0), "an interrupted startup is a failure: {err}");
    assert!(err.contains("interrupted by SIGTERM"), "{err}");
    assert!(err.contains("stopping etcd"), "ordered stop ran: {err}");
    // tandem up waited for each child: nothing may be running now.
    assert_all_gone(&pids, Duration::ZERO);
}

#[test]
fn sigint_while_the_sample_streams_stops_every_process_started() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut up = Up::start(&["--max-tokens", "400", "--exit-after-sample"]);
    up.wait_for_line("streaming a sample answer", Duration::from_secs(180));
    let pids = up.pids();
    assert_eq!(pids.len(), 5, "{pids:?}");
    up.signal(libc::SIGINT);
    let (code, err) = up.wait_exit(GONE_WITHIN);
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains("interrupted by SIGINT"), "{err}");
    assert!(
        !err.contains("is serving"),
        "the sample was cut, not finished: {err}"
    );
    assert_all_gone(&pids, Duration::ZERO);
}

#[test]
fn kill_9_of_tandem_up_leaves_no_process_behind() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut up = Up::start(&["--no-sample"]);
    up.wait_for_line("is serving", Duration::from_secs(180));
    let pids = up.pids();
    assert_eq!(pids.len(), 5, "{pids:?}");
    assert!(pids.iter().all(|(_, p)| alive(*p)), "{pids:?}");
    up.signal(libc::SIGKILL);
    let (code, _) = up.wait_exit(Duration::from_secs(5));
    assert_eq!(code, None, "killed by a signal");
    // The kernel sent each child SIGTERM (its parent-death signal); each drains and exits.
    assert_all_gone(&pids, GONE_WITHIN);
}
