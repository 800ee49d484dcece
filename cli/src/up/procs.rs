//! The child processes of `tandem up` and what guarantees none outlives it.
//!
//! Three ways `tandem up` can end, and what stops its children in each:
//! - **normally or on an error** (startup failed, sample failed): [`Procs`] is dropped and stops
//!   every child in reverse start order (SIGTERM, a grace period, then SIGKILL);
//! - **SIGTERM / SIGINT at any moment** (startup and the sample request included): [`Interrupt`]
//!   turns the signal into a cancelled token; every wait checks it, so `tandem up` unwinds through
//!   the same ordered stop instead of dying with its children running;
//! - **SIGKILL of `tandem up`** (nothing of ours runs): each child was started with
//!   `PR_SET_PDEATHSIG = SIGTERM`, so the kernel sends it SIGTERM when `tandem up` dies and the
//!   node drains and leaves as it would on an operator's SIGTERM. The death signal is tied to the
//!   *thread* that spawned the child, so children are spawned from the thread that owns the
//!   [`Procs`] (the main thread in `tandem up` and `bench-serve`).
//!
//! Every child runs in its own process group, so a terminal's Ctrl-C reaches `tandem up` alone
//! and the shutdown order holds. `<run-dir>/pids` lists `name pid` per child as it starts, for
//! operators and for the tests that check nothing is left behind.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio_util::sync::CancellationToken;

/// How long a stopping child may take before SIGKILL (a node drains in-flight work first).
pub const STOP_GRACE: Duration = Duration::from_secs(40);

/// SIGTERM / SIGINT as a token, so waits can end early. Cheap to clone.
#[derive(Clone, Default)]
pub struct Interrupt {
    token: CancellationToken,
    signal: std::sync::Arc<std::sync::OnceLock<&'static str>>,
}

impl Interrupt {
    /// Takes over SIGTERM and SIGINT for this process (their default action, exit at once, would
    /// leave the children running). Must run before the first child starts.
    pub fn install(rt: &tokio::runtime::Runtime) -> anyhow::Result<Interrupt> {
        use tokio::signal::unix::{SignalKind, signal};
        let this = Interrupt::default();
        // Registered here, synchronously: from this point on neither signal kills the process.
        let (mut term, mut int) = rt.block_on(async {
            anyhow::Ok((
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
            ))
        })?;
        let t = this.clone();
        rt.spawn(async move {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            let _ = t.signal.set(name);
            t.token.cancel();
        });
        Ok(this)
    }

    /// An interrupt that never fires (callers that handle signals themselves, tests).
    pub fn never() -> Interrupt {
        Interrupt::default()
    }

    /// Whether a signal has arrived.
    pub fn fired(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves when a signal arrives.
    pub async fn wait(&self) {
        self.token.cancelled().await
    }

    /// Which signal arrived, if one did.
    pub fn signal(&self) -> Option<&'static str> {
        self.signal.get().copied()
    }

    /// An error naming the signal, for a wait that it ended.
    pub fn error(&self) -> anyhow::Error {
        anyhow::anyhow!(
            "interrupted by {}: stopping every process this command started",
            self.signal().unwrap_or("a signal")
        )
    }
}

/// A child process with its name and log.
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
    program: PathBuf,
    args: Vec<String>,
}

impl Proc {
    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails with the log's tail if the process has exited.
    fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}) during startup; last lines of {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 15)
            );
        }
        Ok(())
    }

    /// SIGTERM, then wait up to `grace`, then SIGKILL.
    fn stop(&mut self, grace: Duration) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        // SAFETY: plain kill(2) on our own child's pid, which we have not reaped yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < grace {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!(
            "tandem up: {} did not stop within {grace:?}; killing it",
            self.name
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The children of one `tandem up`, stopped in reverse start order when dropped.
pub struct Procs {
    procs: Vec<Proc>,
    logs: PathBuf,
    pid_file: PathBuf,
    /// Extra environment for every child (the drills' fault switch).
    env: Vec<(String, String)>,
}

impl Procs {
    /// No children yet; logs go to `<run_dir>/logs`, pids to `<run_dir>/pids`.
    pub fn new(run_dir: &Path) -> anyhow::Result<Procs> {
        let logs = run_dir.join("logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        let pid_file = run_dir.join("pids");
        std::fs::File::create(&pid_file)
            .with_context(|| format!("creating {}", pid_file.display()))?;
        Ok(Procs {
            procs: Vec::new(),
            logs,
            pid_file,
            env: Vec::new(),
        })
    }

    /// Sets extra environment variables for every child started from now on.
    pub fn set_env(&mut self, env: Vec<(String, String)>) {
        self.env = env;
    }

    /// Starts `program args` as `name`, in its own process group, stdout and stderr to
    /// `<logs>/<name>.log`, with SIGTERM as its parent-death signal.
    pub fn spawn(&mut self, name: &str, program: &Path, args: &[String]) -> anyhow::Result<()> {
        let proc = self.start(name, program, args)?;
        self.procs.push(proc);
        Ok(())
    }

    /// Like [`Procs::spawn`], but placed before the child named `before` in the stop order
    /// (so it is stopped after it: nodes started later still stop after the router).
    pub fn spawn_before(
        &mut self,
        before: &str,
        name: &str,
        program: &Path,
        args: &[String],
    ) -> anyhow::Result<()> {
        let proc = self.start(name, program, args)?;
        let at = self
            .procs
            .iter()
            .position(|p| p.name == before)
            .unwrap_or(self.procs.len());
        self.procs.insert(at, proc);
        Ok(())
    }

    /// Removes the children that have exited and whose name `pick` accepts; returns each with
    /// its exit status and the last lines of its log.
    pub fn reap(&mut self, pick: impl Fn(&str) -> bool) -> Vec<(String, std::process::ExitStatus, String)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.procs.len() {
            let p = &mut self.procs[i];
            if pick(&p.name)
                && let Ok(Some(status)) = p.child.try_wait()
            {
                let p = self.procs.remove(i);
                out.push((p.name, status, tail(&p.log, 15)));
                continue;
            }
            i += 1;
        }
        out
    }

    /// Starts the child named `name` again with its original command line, in its place in the
    /// stop order; it must have exited (or been killed: it is reaped here first). Its log goes
    /// on after the old one's.
    pub fn restart(&mut self, name: &str) -> anyhow::Result<u32> {
        let at = self
            .procs
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("no process named {name}"))?;
        let old = &mut self.procs[at];
        if old.child.try_wait()?.is_none() {
            bail!("{name} (pid {}) is still running", old.child.id());
        }
        let (program, args) = (old.program.clone(), old.args.clone());
        let fresh = self.start(name, &program, &args)?;
        self.procs[at] = fresh;
        Ok(self.procs[at].pid())
    }

    /// Every pid `<run-dir>/pids` lists (each child ever started, restarts included) whose
    /// process still runs (not a zombie), as `name pid`.
    pub fn leftovers(&self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.pid_file).unwrap_or_default();
        text.lines()
            .filter(|l| {
                let pid = l.rsplit(' ').next().and_then(|p| p.parse::<u32>().ok());
                pid.is_some_and(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                        // `pid (comm) STATE ...`: the state follows the last `)`.
                        stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()) != Some("Z")
                    })
                })
            })
            .map(str::to_string)
            .collect()
    }

    /// Whether the child named `name` runs.
    pub fn running(&mut self, name: &str) -> bool {
        self.procs
            .iter_mut()
            .find(|p| p.name == name)
            .is_some_and(|p| p.child.try_wait().ok().flatten().is_none())
    }

    /// Sends `signal` to the child named `name`, if it runs.
    pub fn signal(&mut self, name: &str, signal: i32) {
        if let Some(p) = self.procs.iter_mut().find(|p| p.name == name)
            && p.child.try_wait().ok().flatten().is_none()
        {
            // SAFETY: plain kill(2) on our own child's pid, which we have not reaped yet.
            unsafe { libc::kill(p.child.id() as i32, signal) };
        }
    }

    fn start(&mut self, name: &str, program: &Path, args: &[String]) -> anyhow::Result<Proc> {
        let log = self.logs.join(format!("{name}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let parent = std::process::id() as libc::pid_t;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe calls (prctl, getppid).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died between fork and prctl: then no signal will come.
                if libc::getppid() != parent {
                    return Err(std::io::Error::other("parent exited before exec"));
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.pid_file)
            .with_context(|| format!("opening {}", self.pid_file.display()))?;
        writeln!(f, "{name} {}", child.id())?;
        Ok(Proc {
            name: name.to_string(),
            child,
            log,
            program: program.to_path_buf(),
            args: args.to_vec(),
        })
    }

    /// Waits until `cond` holds, checking meanwhile that every child is alive and that no
    /// signal has arrived.
    pub fn wait_until(
        &mut self,
        what: &str,
        deadline: Instant,
        interrupt: &Interrupt,
        mut cond: impl FnMut() -> bool,
    ) -> anyhow::Result<()> {
        loop {
            if interrupt.fired() {
                return Err(interrupt.error());
            }
            if cond() {
                return Ok(());
            }
            for p in self.procs.iter_mut() {
                p.check_alive()?;
            }
            if Instant::now() > deadline {
                bail!("timed out waiting for {what}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops every child in reverse start order.
    pub fn shutdown(&mut self) {
        while let Some(mut p) = self.procs.pop() {
            eprintln!("tandem up: stopping {}", p.name);
            p.stop(STOP_GRACE);
        }
    }

    /// The running children, in start order.
    pub fn iter(&self) -> impl Iterator<Item = &Proc> {
        self.procs.iter()
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The last `lines` lines of a log file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
