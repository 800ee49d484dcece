//! `GET /metrics`: the router's counters in the Prometheus text format (0.0.4).
//!
//! Only counts of things that happened and current gauges read from live state: nothing is
//! estimated. Latency histograms, token counts and cost come with the observability issue.

use std::fmt::Write;

use tandem_cluster::Role;

use crate::pipeline::Router;

fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(&str, u64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, v) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {v}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
    }
}

/// Renders every counter and gauge.
pub fn render(router: &Router) -> String {
    let s = router.stats();
    let mut out = String::new();
    metric(
        &mut out,
        "tandem_router_requests_total",
        "counter",
        "Requests by outcome.",
        &[
            ("outcome=\"admitted\"", s.admitted),
            ("outcome=\"completed\"", s.completed),
            ("outcome=\"failed\"", s.failed),
            ("outcome=\"cancelled\"", s.cancelled),
            ("outcome=\"overloaded\"", s.overloaded),
        ],
    );
    metric(
        &mut out,
        "tandem_router_recoveries_total",
        "counter",
        "Attempts repeated after a retry-safe failure, by kind.",
        &[
            ("kind=\"retry\"", s.retries),
            ("kind=\"reprefill\"", s.reprefills),
            ("kind=\"migration\"", s.migrations),
            ("kind=\"reserve_refused\"", s.reserve_refusals),
            ("kind=\"release\"", s.releases),
        ],
    );
    let (p, d) = (s.prefill, s.decode);
    metric(
        &mut out,
        "tandem_router_routing_picks_total",
        "counter",
        "Node choices, by role and by source (NATS load reports or the router's own in-flight counts).",
        &[
            ("role=\"prefill\",source=\"load_report\"", p.load_picks),
            ("role=\"prefill\",source=\"fallback\"", p.fallback_picks),
            ("role=\"decode\",source=\"load_report\"", d.load_picks),
            ("role=\"decode\",source=\"fallback\"", d.fallback_picks),
        ],
    );
    metric(
        &mut out,
        "tandem_router_load_fallback_entered_total",
        "counter",
        "Times routing switched to in-flight counts because load reports were stale or absent.",
        &[
            ("role=\"prefill\"", p.fallback_entered),
            ("role=\"decode\"", d.fallback_entered),
        ],
    );
    let (np, nd) = router.available_nodes();
    metric(
        &mut out,
        "tandem_router_nodes",
        "gauge",
        "Nodes accepting work, by role.",
        &[
            ("role=\"prefill\"", np as u64),
            ("role=\"decode\"", nd as u64),
        ],
    );
    metric(
        &mut out,
        "tandem_router_load_signals_connected",
        "gauge",
        "1 while the NATS load bus is connected.",
        &[("", u64::from(router.load_signals_connected()))],
    );
    let _ = writeln!(
        out,
        "# HELP tandem_router_in_flight Requests in flight per node.\n# TYPE tandem_router_in_flight gauge"
    );
    for role in [Role::Prefill, Role::Decode] {
        for (node, n) in router.in_flight_by_node(role) {
            let node = node.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                out,
                "tandem_router_in_flight{{role=\"{}\",node=\"{node}\"}} {n}",
                role.as_str()
            );
        }
    }
    out
}
