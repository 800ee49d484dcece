//! `tandem scale`: shows or sets the pools' sizes and bounds by hand.
//!
//! ```text
//! tandem scale                          # targets, bounds and serving nodes per pool
//! tandem scale prefill=3 decode=2       # ask for sizes (refused outside the bounds)
//! tandem scale --max prefill=6          # change a bound
//! ```
//! Sizes are written to etcd (`/tandem/{cluster}/scale/{pool}`); the executor (`tandem up`'s
//! reconciler) starts nodes (which warm up before serving) or drains them. With `--wait-secs`
//! it waits until each pool serves the size asked for. A running planner may change the sizes
//! again on its next decision: narrow its bounds (`--min`/`--max`) to hold a size.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use tandem_cluster::{
    Discovery, EtcdDiscovery, NodeState, PoolBounds, Role, ScaleLimits, ScaleStore,
};

/// Flags of `tandem scale`.
#[derive(Args, Debug, Clone)]
pub struct ScaleArgs {
    /// Sizes to ask for, as POOL=N (pools: prefill, decode).
    pub sizes: Vec<String>,
    /// Set a pool's minimum, as POOL=N.
    #[arg(long = "min")]
    pub mins: Vec<String>,
    /// Set a pool's maximum, as POOL=N.
    #[arg(long = "max")]
    pub maxes: Vec<String>,
    #[command(flatten)]
    pub target: crate::control::ClusterTarget,
    /// Wait up to this long for each pool to serve its target (the pools named in SIZES, or
    /// every pool when none is named; 0: do not wait).
    #[arg(long, default_value_t = 0)]
    pub wait_secs: u64,
    /// Print the ids of the pool's registered nodes, one per line (for scripts), and nothing else.
    #[arg(long, value_name = "POOL", value_parser = ["prefill", "decode"])]
    pub ids: Option<String>,
}

/// Parses `POOL=N` items; unknown pools and bad numbers are refused, naming them.
pub fn parse_sizes(items: &[String]) -> anyhow::Result<BTreeMap<Role, usize>> {
    let mut out = BTreeMap::new();
    for item in items {
        let Some((pool, n)) = item.split_once('=') else {
            bail!("`{item}`: expected POOL=N, e.g. prefill=3");
        };
        let role = match pool {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            other => bail!("unknown pool `{other}` in `{item}` (pools: prefill, decode)"),
        };
        let n: usize = n
            .parse()
            .with_context(|| format!("`{item}`: {n:?} is not a node count"))?;
        out.insert(role, n);
    }
    Ok(out)
}

async fn serving(d: &EtcdDiscovery, role: Role) -> anyhow::Result<usize> {
    Ok(d.list(role)
        .await?
        .values()
        .filter(|n| n.state == NodeState::Serving)
        .count())
}

/// Runs `tandem scale`; returns what to print.
pub fn run(args: &ScaleArgs) -> anyhow::Result<String> {
    let sizes = parse_sizes(&args.sizes)?;
    let (mins, maxes) = (parse_sizes(&args.mins)?, parse_sizes(&args.maxes)?);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let d = args.target.discovery().await?;
        let store = d.scale_store();
        if !mins.is_empty() || !maxes.is_empty() {
            let mut limits = store.limits().await?.unwrap_or(ScaleLimits {
                prefill: PoolBounds { min: 1, max: 1 },
                decode: PoolBounds { min: 1, max: 1 },
            });
            for (role, n) in &mins {
                match role {
                    Role::Prefill => limits.prefill.min = *n,
                    Role::Decode => limits.decode.min = *n,
                }
            }
            for (role, n) in &maxes {
                match role {
                    Role::Prefill => limits.prefill.max = *n,
                    Role::Decode => limits.decode.max = *n,
                }
            }
            store.set_limits(limits).await?;
        }
        for (role, n) in &sizes {
            store.set_target(*role, *n).await?;
            eprintln!("tandem scale: {role} pool asked for {n} node(s)");
        }
        if let Some(pool) = &args.ids {
            let role = if pool == "prefill" {
                Role::Prefill
            } else {
                Role::Decode
            };
            let ids: Vec<String> = d.list(role).await?.into_keys().collect();
            return Ok(ids.join("\n"));
        }
        let t0 = Instant::now();
        if args.wait_secs > 0 {
            let wait: Vec<(Role, usize)> = if sizes.is_empty() {
                let t = store.targets().await?;
                [Role::Prefill, Role::Decode]
                    .into_iter()
                    .filter_map(|r| t.of(r).map(|n| (r, n)))
                    .collect()
            } else {
                sizes.iter().map(|(r, n)| (*r, *n)).collect()
            };
            for (role, n) in &wait {
                let mut last = None;
                loop {
                    let now = serving(&d, *role).await?;
                    if last != Some(now) {
                        eprintln!("tandem scale: {role}: {now} of {n} serving");
                        last = Some(now);
                    }
                    if now == *n {
                        break;
                    }
                    if t0.elapsed() > Duration::from_secs(args.wait_secs) {
                        bail!(
                            "{role} pool serves {now} node(s), not {n}, after {} s",
                            args.wait_secs
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
        let (targets, limits) = (store.targets().await?, store.limits().await?);
        let mut out = String::from("pool     target  serving  min  max  nodes\n");
        for role in [Role::Prefill, Role::Decode] {
            let (min, max) = limits
                .map(|l| (l.of(role).min.to_string(), l.of(role).max.to_string()))
                .unwrap_or(("-".into(), "-".into()));
            let nodes: Vec<String> = d
                .list(role)
                .await?
                .values()
                .map(|n| format!("{} ({})", n.node_id, n.state.as_str()))
                .collect();
            out += &format!(
                "{:<8} {:>6}  {:>7}  {min:>3}  {max:>3}  {}\n",
                role.as_str(),
                targets
                    .of(role)
                    .map(|n| n.to_string())
                    .unwrap_or("-".into()),
                serving(&d, role).await?,
                nodes.join(", "),
            );
        }
        if args.wait_secs > 0 {
            out += &format!("reached in {:.1} s\n", t0.elapsed().as_secs_f64());
        }
        Ok(out.trim_end().to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_unknown_pools_are_named() {
        let s = parse_sizes(&["prefill=3".into(), "decode=0".into()]).unwrap();
        assert_eq!((s[&Role::Prefill], s[&Role::Decode]), (3, 0));
        let e = parse_sizes(&["encode=2".into()]).unwrap_err().to_string();
        assert!(e.contains("unknown pool `encode`"), "{e}");
        assert!(parse_sizes(&["prefill".into()]).is_err());
        let e = format!("{:#}", parse_sizes(&["decode=-1".into()]).unwrap_err());
        assert!(e.contains("not a node count"), "{e}");
    }
}
