//! `tandem drain NODE`: asks a node to drain and leave, and waits until it has. The node
//! stops taking new work (its record says `draining`, routers send it nothing new), finishes
//! its running streams (those still running at its `--drain-timeout-secs` are ended and the
//! routers migrate them), deregisters and exits 0. Scale-downs use the same request.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use tandem_cluster::{Discovery, Role};

/// Flags of `tandem drain`.
#[derive(Args, Debug, Clone)]
pub struct DrainArgs {
    /// The node's id (as registered, e.g. `decode-1`).
    pub node_id: String,
    /// The node's role (default: whichever role has a node with that id).
    #[arg(long, value_parser = ["prefill", "decode"])]
    pub role: Option<String>,
    #[command(flatten)]
    pub target: crate::control::ClusterTarget,
    /// How long to wait for the node to leave (0: do not wait).
    #[arg(long, default_value_t = 120)]
    pub wait_secs: u64,
}

/// Runs `tandem drain`; returns what to print.
pub fn run(args: &DrainArgs) -> anyhow::Result<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let d = args.target.discovery().await?;
        let roles: Vec<Role> = match args.role.as_deref() {
            Some("prefill") => vec![Role::Prefill],
            Some(_) => vec![Role::Decode],
            None => vec![Role::Prefill, Role::Decode],
        };
        let mut role = None;
        for r in roles {
            let view = d
                .list(r)
                .await
                .with_context(|| format!("listing {r} nodes in etcd ({:?})", args.target.etcd_endpoints))?;
            if view.contains_key(&args.node_id) {
                role = Some(r);
                break;
            }
        }
        let Some(role) = role else {
            bail!(
                "no node `{}` is registered in cluster `{}`",
                args.node_id,
                args.target.cluster
            );
        };
        d.request_drain(role, &args.node_id).await?;
        eprintln!("tandem drain: asked {role} node {} to drain", args.node_id);
        if args.wait_secs == 0 {
            return Ok(format!("{} draining", args.node_id));
        }
        let t0 = Instant::now();
        let mut last = None;
        loop {
            let view = d.list(role).await?;
            match view.get(&args.node_id) {
                None => {
                    return Ok(format!(
                        "{} drained and left in {:.1} s",
                        args.node_id,
                        t0.elapsed().as_secs_f64()
                    ));
                }
                Some(info) => {
                    if last != Some(info.state) {
                        eprintln!("tandem drain: {} is {}", args.node_id, info.state.as_str());
                        last = Some(info.state);
                    }
                }
            }
            if t0.elapsed() > Duration::from_secs(args.wait_secs) {
                bail!(
                    "{} has not left after {} s (it may still be finishing streams; its --drain-timeout-secs bounds that)",
                    args.node_id,
                    args.wait_secs
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}
