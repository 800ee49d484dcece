//! The control plane's deterministic simulation (see `sim/mod.rs`): the real router over a
//! simulated network, hundreds of seeded fault plans (node crashes and restarts, partitions
//! with lease lapses, held links, revoked leases, cut KV links), and the invariants checked
//! after each.
//! `TANDEM_SEED=N` runs one seed (a failing seed's message names it); `TANDEM_SIM_SEEDS=N`
//! changes how many the suite runs. One seed logs the router's lines as well
//! (`RUST_LOG=tandem_router=debug TANDEM_SEED=N`).

use crate::common;
use crate::sim;

#[test]
fn control_plane_invariants_hold_under_seeded_faults() {
    let seeds: Vec<u64> = match std::env::var("TANDEM_SEED") {
        Ok(s) => {
            // One seed: the router's logs too (`RUST_LOG=tandem_router=debug` for more).
            common::init_tracing();
            vec![s.parse().expect("TANDEM_SEED is a number")]
        }
        Err(_) => {
            let n: u64 = std::env::var("TANDEM_SIM_SEEDS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(200);
            (1..=n).collect()
        }
    };
    let model = common::model();
    let (mut failures, mut ok, mut failed, mut recoveries, mut expired) = (Vec::new(), 0, 0, 0, 0);
    let (mut reservations, mut sent, mut received, mut cancelled, mut fault_free) = (0, 0, 0, 0, 0);
    let mut kinds = std::collections::BTreeMap::<&str, usize>::new();
    let mut errors = std::collections::BTreeMap::<String, usize>::new();
    for &seed in &seeds {
        let report = sim::run_seed(seed, model.clone());
        for f in &report.faults {
            let kind = match f {
                sim::Fault::Crash { .. } => "crash",
                sim::Fault::Partition { .. } => "partition",
                sim::Fault::Hold { .. } => "hold",
                sim::Fault::Revoke { .. } => "revoke",
                sim::Fault::CutKv { .. } => "cut-kv",
            };
            *kinds.entry(kind).or_default() += 1;
        }
        for e in &report.errors {
            // The error without its node names and numbers: one line per kind of failure.
            let shape: String = e.chars().filter(|c| !c.is_ascii_digit()).collect();
            *errors.entry(shape).or_default() += 1;
        }
        ok += report.ok;
        failed += report.failed;
        recoveries += report.recoveries;
        expired += report.expired;
        reservations += report.reservations;
        sent += report.releases_sent;
        received += report.releases_received;
        cancelled += report.cancelled;
        fault_free += usize::from(report.faults.is_empty());
        if !report.violations.is_empty() {
            failures.push(format!(
                "seed {seed} (rerun: TANDEM_SEED={seed}): faults {:?}\n    {}",
                report.faults,
                report.violations.join("\n    ")
            ));
        }
    }
    eprintln!(
        "{} seeds ({fault_free} without faults): {ok} requests answered, {failed} failed with a clear error, {cancelled} cancelled by their client, {recoveries} router recoveries; {reservations} reservations, {sent} Releases sent by the router and {received} received, {expired} expired; faults {kinds:?}",
        seeds.len()
    );
    for (e, n) in &errors {
        eprintln!("  {n} × {e}");
    }
    assert!(failures.is_empty(), "{} seed(s) broke an invariant:\n{}", failures.len(), failures.join("\n"));
    if seeds.len() > 20 {
        // The faults hit: the router had to recover, and every kind of fault was drawn.
        assert!(recoveries > 0, "no seed made the router retry, re-prefill or migrate");
        assert_eq!(kinds.len(), 5, "{kinds:?}");
        assert!(ok > failed * 10, "{ok} answered, {failed} failed");
        // Each expiry is excused seed by seed (a fault on its nodes); they must also stay rare.
        assert!(
            expired * 50 <= reservations,
            "{expired} of {reservations} reservations expired (more than 2%)"
        );
        assert!(received <= sent, "{received} Releases received, {sent} sent");
        assert!(fault_free > 0 && cancelled > 0, "{fault_free} fault-free seeds, {cancelled} cancels");
    }
}
