//! `tandem up --prometheus`: a real Prometheus (Debian `prometheus`) scraping every process of
//! the local cluster.
//!
//! ```text
//!  <run-dir>/prometheus/prometheus.yml   scrape every 1 s; rules: alerts.yml
//!                       alerts.yml       deploy/observability/alerts.yml, built into the binary
//!                       targets.json     file-based service discovery: the router's HTTP port and
//!                                        every node's `metrics_url` from its etcd record,
//!                                        rewritten (atomically) whenever membership changes
//!                       data/            the TSDB
//! ```
//!
//! The targets file follows etcd through the same watch the router uses, so a node that joins
//! is scraped within a refresh (1 s) and one that leaves stops being scraped; Prometheus reads
//! the file again on every change.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use tandem_cluster::{Discovery, NodeView, Role};
use tokio::sync::watch;

use super::procs::{Interrupt, Procs};

/// The alert rules every `tandem up --prometheus` loads (the file operators deploy).
pub const ALERT_RULES: &str = include_str!("../../../deploy/observability/alerts.yml");

/// Writes the configuration for scraping `router_http` and the nodes listed in `targets.json`.
pub fn write_config(dir: &Path, scrape_interval: Duration) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("alerts.yml"), ALERT_RULES)?;
    let secs = scrape_interval.as_secs().max(1);
    let config = format!(
        "# Written by `tandem up --prometheus`; targets.json is kept current from etcd.\n\
         global:\n  scrape_interval: {secs}s\n  evaluation_interval: {secs}s\n\
         rule_files:\n  - alerts.yml\n\
         scrape_configs:\n  - job_name: tandem\n    file_sd_configs:\n      - files: [targets.json]\n        refresh_interval: 1s\n"
    );
    let path = dir.join("prometheus.yml");
    std::fs::write(&path, config)?;
    Ok(path)
}

/// The file-SD JSON for the router at `router_http` and the nodes in `views`.
pub fn targets_json(router_http: SocketAddr, views: &[(Role, NodeView)]) -> String {
    let mut groups = vec![serde_json::json!({
        "targets": [router_http.to_string()],
        "labels": {"tandem_process": "router"},
    })];
    for (_, view) in views {
        for info in view.values() {
            let Some((target, path)) = split_metrics_url(&info.metrics_url) else {
                continue;
            };
            groups.push(serde_json::json!({
                "targets": [target],
                "labels": {"__metrics_path__": path, "tandem_process": info.node_id},
            }));
        }
    }
    serde_json::to_string_pretty(&groups).expect("plain JSON values serialise")
}

/// `http://host:port/path` → (`host:port`, `/path`).
fn split_metrics_url(url: &str) -> Option<(String, String)> {
    let rest = url.strip_prefix("http://")?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/metrics"),
    };
    (!host.is_empty()).then(|| (host.to_string(), path.to_string()))
}

fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, path)
}

/// Starts Prometheus as a child in `procs` with the configuration in `<run_dir>/prometheus`,
/// keeps `targets.json` current from `discovery` on `rt`, and waits until it is ready. Returns
/// its URL.
#[allow(clippy::too_many_arguments)]
pub fn start(
    procs: &mut Procs,
    run_dir: &Path,
    prometheus_bin: &Path,
    listen: SocketAddr,
    router_http: SocketAddr,
    discovery: std::sync::Arc<dyn Discovery>,
    rt: &tokio::runtime::Runtime,
    interrupt: &Interrupt,
    deadline: Instant,
) -> anyhow::Result<String> {
    let dir = run_dir.join("prometheus");
    let config = write_config(&dir, Duration::from_secs(1))?;
    let targets = dir.join("targets.json");
    let views = rt.block_on(async {
        anyhow::Ok((
            discovery.watch(Role::Prefill).await?,
            discovery.watch(Role::Decode).await?,
        ))
    })?;
    write_atomically(&targets, &targets_json(router_http, &current(&views)))?;
    rt.spawn(follow(views, router_http, targets));
    let args = vec![
        format!("--config.file={}", config.display()),
        format!("--storage.tsdb.path={}", dir.join("data").display()),
        format!("--web.listen-address={listen}"),
        "--log.level=warn".into(),
    ];
    procs.spawn("prometheus", prometheus_bin, &args)?;
    let url = format!("http://{listen}");
    procs.wait_until("Prometheus to be ready", deadline, interrupt, || {
        super::http_get_ok(listen, "/-/ready")
    })?;
    Ok(url)
}

type Views = (watch::Receiver<NodeView>, watch::Receiver<NodeView>);

fn current(views: &Views) -> Vec<(Role, NodeView)> {
    vec![
        (Role::Prefill, views.0.borrow().clone()),
        (Role::Decode, views.1.borrow().clone()),
    ]
}

/// Rewrites the targets file on every membership change, until the views close.
async fn follow(mut views: Views, router_http: SocketAddr, path: PathBuf) {
    loop {
        tokio::select! {
            r = views.0.changed() => if r.is_err() { return },
            r = views.1.changed() => if r.is_err() { return },
        }
        let text = targets_json(router_http, &current(&views));
        if let Err(e) = write_atomically(&path, &text) {
            tracing::warn!(error = %e, path = %path.display(), "could not update Prometheus targets");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_cluster::NodeInfo;
    use tandem_kv_layout::KvLayout;

    #[test]
    fn targets_list_the_router_and_every_node_with_a_metrics_url() {
        let layout = KvLayout::new(30, 3, 64, 16, tandem_kv_layout::KvDtype::F32, 1).unwrap();
        let mut view = NodeView::new();
        for (id, url) in [
            ("decode-0", "http://127.0.0.1:9101/metrics"),
            ("decode-old", ""),
        ] {
            view.insert(
                id.into(),
                NodeInfo::new(id, Role::Decode, "http://x:1", layout, 8).with_metrics_url(url),
            );
        }
        let text = targets_json("127.0.0.1:8000".parse().unwrap(), &[(Role::Decode, view)]);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let groups = v.as_array().unwrap();
        assert_eq!(groups.len(), 2, "{text}");
        assert_eq!(groups[0]["targets"][0], "127.0.0.1:8000");
        assert_eq!(groups[1]["targets"][0], "127.0.0.1:9101");
        assert_eq!(groups[1]["labels"]["__metrics_path__"], "/metrics");
        assert_eq!(groups[1]["labels"]["tandem_process"], "decode-0");
    }
}
