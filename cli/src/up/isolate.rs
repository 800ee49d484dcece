//! What two drills need of the machine (root only): a node in its own network namespace that a
//! partition can cut off, and etcd's data directory on a disk small enough to fill.
//!
//! ```text
//!  host namespace                               namespace tandem-<pid>-<n>
//!  etcd, NATS  listen on HOST_IP  ─┐
//!  router, other nodes             ├─ veth tdm<pid>h<n> ══ tdm<pid>n<n> ─ the node: NODE_IP
//!                                  ┘     (HOST_IP/30)            (NODE_IP/30)
//! ```
//! Cutting is `ip link set <host end> down`: the host drops its route to NODE_IP (new connects
//! fail at once, established ones see nothing), the node loses every peer (etcd, NATS, the
//! router's streams, KV pushes), and HOST_IP still answers processes of the host namespace.
//! Healing sets the link up again and the routes come back.
//!
//! Invariants: whatever [`NetPartition::create`] or [`SmallDisk::mount`] set up is taken down
//! when the value drops (the veth pair, the namespace, the mount), after the cluster's
//! processes have stopped ([`super::Cluster`] holds them after its processes); both refuse up
//! front, naming what is missing, on a machine that does not let this process do it.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, bail};

/// Why this process cannot build namespaces or mount disks, if it cannot.
pub fn missing_privilege(what: &str) -> Option<String> {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some(format!(
            "{what} needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN: network namespaces, veth pairs, mounts); run it as root, e.g. `sudo -E tandem drill ...`"
        ));
    }
    if super::which("ip").is_none() {
        return Some(format!(
            "{what} needs `ip` (Debian package iproute2: sudo apt-get install iproute2)"
        ));
    }
    None
}

fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Numbers namespaces within this process (several drills in one run).
static NEXT: AtomicU32 = AtomicU32::new(0);

/// One node's own network namespace, joined to the host by a veth pair.
#[derive(Debug)]
pub struct NetPartition {
    /// The node that runs inside (`decode-0`).
    pub node: String,
    /// The namespace's name.
    pub netns: String,
    /// The host end of the veth pair (the one a cut sets down).
    host_if: String,
    /// The host end's address: etcd and NATS listen here so the node can reach them.
    pub host_ip: Ipv4Addr,
    /// The node's address inside the namespace.
    pub node_ip: Ipv4Addr,
}

impl NetPartition {
    /// Builds the namespace and the veth pair for `node`.
    pub fn create(node: &str) -> anyhow::Result<NetPartition> {
        if let Some(why) = missing_privilege("a network partition") {
            bail!(why);
        }
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        // A /30 per namespace in 10.231.0.0/16, spread by pid so two runs rarely meet.
        let slot = (pid.wrapping_mul(7).wrapping_add(n)) % 16_384;
        let base = u32::from(Ipv4Addr::new(10, 231, 0, 0)) + slot * 4;
        let part = NetPartition {
            node: node.to_string(),
            netns: format!("tandem-{pid}-{n}"),
            host_if: format!("tdm{}h{n}", pid % 10_000_000),
            host_ip: Ipv4Addr::from(base + 1),
            node_ip: Ipv4Addr::from(base + 2),
        };
        let peer_if = format!("tdm{}n{n}", pid % 10_000_000);
        // Leftovers of an earlier process with the same pid (killed before it cleaned up).
        let _ = run("ip", &["link", "del", &part.host_if]);
        let _ = run("ip", &["netns", "del", &part.netns]);
        run("ip", &["netns", "add", &part.netns])?;
        // From here on, dropping `part` removes what exists.
        let (host_cidr, node_cidr) = (
            format!("{}/30", part.host_ip),
            format!("{}/30", part.node_ip),
        );
        let ns = part.netns.as_str();
        let steps: [&[&str]; 7] = [
            &[
                "link",
                "add",
                &part.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &peer_if,
            ],
            &["link", "set", &peer_if, "netns", ns],
            &["addr", "add", &host_cidr, "dev", &part.host_if],
            &["link", "set", &part.host_if, "up"],
            &["-n", ns, "addr", "add", &node_cidr, "dev", &peer_if],
            &["-n", ns, "link", "set", &peer_if, "up"],
            &["-n", ns, "link", "set", "lo", "up"],
        ];
        for args in steps {
            run("ip", args)?;
        }
        Ok(part)
    }

    /// The command line that starts `program args` inside the namespace, listening on the
    /// node's address (gRPC, KV transfer and metrics on free ports).
    pub fn wrap(&self, program: &Path, args: Vec<String>) -> (PathBuf, Vec<String>) {
        let ip = super::which("ip").unwrap_or_else(|| PathBuf::from("/usr/sbin/ip"));
        let mut a = vec!["netns".into(), "exec".into(), self.netns.clone()];
        a.push(program.display().to_string());
        a.extend(args);
        for flag in ["--grpc-addr", "--kv-addr", "--metrics-addr"] {
            a.extend([flag.to_string(), format!("{}:0", self.node_ip)]);
        }
        (ip, a)
    }

    /// Cuts the node off (`true`) or joins it again (`false`).
    pub fn set_cut(&self, cut: bool) -> anyhow::Result<()> {
        run(
            "ip",
            &[
                "link",
                "set",
                &self.host_if,
                if cut { "down" } else { "up" },
            ],
        )
    }
}

impl Drop for NetPartition {
    fn drop(&mut self) {
        // Deleting one end deletes the pair; the namespace goes once its last process has.
        if let Err(e) = run("ip", &["link", "del", &self.host_if]) {
            tracing::warn!(error = %e, "removing the partition's veth pair failed");
        }
        if let Err(e) = run("ip", &["netns", "del", &self.netns]) {
            tracing::warn!(error = %e, "removing network namespace {} failed", self.netns);
        }
    }
}

/// A size-limited tmpfs mounted over a data directory, which the drill can fill.
#[derive(Debug)]
pub struct SmallDisk {
    dir: PathBuf,
    filler: PathBuf,
    /// Its size, MiB.
    pub size_mib: u64,
}

impl SmallDisk {
    /// Mounts a `size_mib` MiB tmpfs (mode 0700, as etcd wants its data directory) on `dir`.
    pub fn mount(dir: &Path, size_mib: u64) -> anyhow::Result<SmallDisk> {
        if let Some(why) = missing_privilege("a full disk") {
            bail!(why);
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let opts = format!("size={size_mib}m,mode=0700");
        let d = dir.display().to_string();
        run("mount", &["-t", "tmpfs", "-o", &opts, "tmpfs", &d])?;
        Ok(SmallDisk {
            dir: dir.to_path_buf(),
            filler: dir.join("tandem-drill-filler"),
            size_mib,
        })
    }

    /// Writes a file until the disk refuses more (ENOSPC); returns the bytes it took.
    pub fn fill(&self) -> anyhow::Result<u64> {
        let mut f = std::fs::File::create(&self.filler)
            .with_context(|| format!("creating {}", self.filler.display()))?;
        let chunk = vec![0xa5u8; 1 << 20];
        let mut written = 0u64;
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(n) => written += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => return Err(e).context("filling the disk"),
            }
        }
        Ok(written)
    }

    /// Removes what [`SmallDisk::fill`] wrote.
    pub fn free(&self) -> anyhow::Result<()> {
        std::fs::remove_file(&self.filler)
            .with_context(|| format!("removing {}", self.filler.display()))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let d = self.dir.display().to_string();
        if let Err(e) = run("umount", &[&d]).or_else(|_| run("umount", &["-l", &d])) {
            tracing::warn!(error = %e, "unmounting {d} failed");
        }
    }
}
