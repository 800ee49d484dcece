//! etcd going away and coming back: views keep their last value, registrations come back.
//!
//! Each test owns its etcd (lease TTL 2 s). Outages are real: the server is SIGKILLed and
//! restarted on the same port, with its data (a crash) or without (a lost etcd).

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use tandem_cluster::testing::TestEtcd;
use tandem_cluster::{
    ClusterError, Discovery, EtcdConfig, EtcdDiscovery, NodeView, Registration, RegistrationState,
    Role,
};

/// How long an outage lasts: longer than the lease TTL, so a lease that was not restored by
/// etcd would have expired.
const OUTAGE: Duration = Duration::from_secs(3);
/// Generous bound on recovery after etcd answers again (retry backoff tops out at 2 s).
const RECOVERY: Duration = Duration::from_secs(10);

async fn client(etcd: &TestEtcd, cluster: &str) -> EtcdDiscovery {
    let mut config = EtcdConfig::new(vec![etcd.endpoint()], cluster).with_lease_ttl(TEST_TTL);
    config.request_timeout = Duration::from_secs(1);
    EtcdDiscovery::connect(config).await.expect("etcd client")
}

fn lease_of(registration: &Registration) -> Option<i64> {
    match *registration.state().borrow() {
        RegistrationState::Live { lease_id } => Some(lease_id),
        _ => None,
    }
}

async fn wait_state(
    registration: &Registration,
    limit: Duration,
    what: &str,
    pred: impl FnMut(&RegistrationState) -> bool,
) -> RegistrationState {
    wait_for(&mut registration.state(), limit, what, pred).await
}

#[tokio::test]
async fn watch_keeps_its_last_view_through_an_outage_and_refreshes_after() {
    init_tracing();
    let mut etcd = TestEtcd::start().await;
    let cluster = cluster_name("outage");
    let node_side = client(&etcd, &cluster).await;
    let router_side = client(&etcd, &cluster).await;
    let p0 = node_side.register(node("p0", Role::Prefill)).await.unwrap();
    let mut view = router_side.watch(Role::Prefill).await.unwrap();
    wait_for(
        &mut view,
        Duration::from_secs(1),
        "p0 in view",
        |v: &NodeView| v.contains_key("p0"),
    )
    .await;

    etcd.stop();
    wait_state(
        &p0,
        Duration::from_secs(5),
        "registration notices the outage",
        |s| *s == RegistrationState::Reconnecting,
    )
    .await;
    tokio::time::sleep(OUTAGE).await;
    assert!(
        view.borrow().contains_key("p0"),
        "the view must keep its last value during the outage"
    );
    assert!(
        router_side
            .list(Role::Prefill)
            .await
            .is_err_and(|e| e.is_retryable()),
        "listing while etcd is down fails retryably"
    );

    etcd.restart().await;
    let back = Instant::now();
    wait_state(&p0, RECOVERY, "registration live again", |s| {
        matches!(s, RegistrationState::Live { .. })
    })
    .await;
    eprintln!("registration live {:?} after etcd answered", back.elapsed());
    // A node that joins after the outage shows up: the watch is following etcd again.
    let _p1 = client(&etcd, &cluster)
        .await
        .register(node("p1", Role::Prefill))
        .await
        .unwrap();
    wait_for(
        &mut view,
        RECOVERY,
        "p1 in view after restart",
        |v: &NodeView| v.contains_key("p1"),
    )
    .await;
    eprintln!("view refreshed {:?} after etcd answered", back.elapsed());
    let listed = router_side.list(Role::Prefill).await.unwrap();
    assert!(
        listed.contains_key("p0") && listed.contains_key("p1"),
        "{listed:?}"
    );
}

#[tokio::test]
async fn nodes_register_again_after_etcd_loses_its_data() {
    init_tracing();
    let mut etcd = TestEtcd::start().await;
    let cluster = cluster_name("wiped");
    let node_side = client(&etcd, &cluster).await;
    let router_side = client(&etcd, &cluster).await;
    let p0 = node_side.register(node("p0", Role::Prefill)).await.unwrap();
    let d0 = node_side.register(node("d0", Role::Decode)).await.unwrap();
    let old_leases = (lease_of(&p0).unwrap(), lease_of(&d0).unwrap());
    let mut view = router_side.watch(Role::Decode).await.unwrap();
    wait_for(
        &mut view,
        Duration::from_secs(1),
        "d0 in view",
        |v: &NodeView| v.contains_key("d0"),
    )
    .await;

    etcd.restart_empty().await;
    for (registration, old) in [(&p0, old_leases.0), (&d0, old_leases.1)] {
        wait_state(
            registration,
            RECOVERY,
            "re-registered under a new lease",
            |s| matches!(s, RegistrationState::Live { lease_id } if *lease_id != old),
        )
        .await;
    }
    let prefill = router_side.list(Role::Prefill).await.unwrap();
    let decode = router_side.list(Role::Decode).await.unwrap();
    assert!(
        prefill.contains_key("p0") && decode.contains_key("d0"),
        "{prefill:?} {decode:?}"
    );
    // The re-registered nodes set the cluster's layout again: a stranger is still refused.
    let stranger = client(&etcd, &cluster)
        .await
        .register(node_with_layout("d9", Role::Decode, layout(9)))
        .await;
    assert!(
        matches!(stranger, Err(ClusterError::LayoutMismatch { .. })),
        "{stranger:?}"
    );
    // And the router's watch follows the new etcd.
    let _d1 = client(&etcd, &cluster)
        .await
        .register(node("d1", Role::Decode))
        .await
        .unwrap();
    wait_for(&mut view, RECOVERY, "d1 in view", |v: &NodeView| {
        v.contains_key("d1") && v.contains_key("d0")
    })
    .await;
}

#[tokio::test]
async fn revoked_lease_is_replaced_by_a_new_registration() {
    init_tracing();
    let etcd = TestEtcd::start().await;
    let cluster = cluster_name("revoked");
    let discovery = client(&etcd, &cluster).await;
    let d0 = discovery.register(node("d0", Role::Decode)).await.unwrap();
    let old_lease = lease_of(&d0).expect("live after register");
    let mut view = discovery.watch(Role::Decode).await.unwrap();
    wait_for(
        &mut view,
        Duration::from_secs(1),
        "d0 in view",
        |v: &NodeView| v.contains_key("d0"),
    )
    .await;

    let mut admin = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    admin.lease_revoke(old_lease).await.expect("revoke");
    wait_for(
        &mut view,
        Duration::from_secs(1),
        "revoked record gone",
        |v: &NodeView| v.is_empty(),
    )
    .await;
    let revoked_at = Instant::now();
    wait_state(
        &d0,
        Duration::from_secs(5),
        "re-registered",
        |s| matches!(s, RegistrationState::Live { lease_id } if *lease_id != old_lease),
    )
    .await;
    wait_for(
        &mut view,
        Duration::from_secs(1),
        "d0 back",
        |v: &NodeView| v.contains_key("d0"),
    )
    .await;
    eprintln!(
        "record back {:?} after its lease was revoked",
        revoked_at.elapsed()
    );
    // The new lease is kept alive like the first: the record outlives several TTLs.
    tokio::time::sleep(TEST_TTL * 2).await;
    assert!(
        discovery
            .list(Role::Decode)
            .await
            .unwrap()
            .contains_key("d0")
    );
}

#[tokio::test]
async fn draining_set_during_an_outage_is_written_when_etcd_returns() {
    init_tracing();
    let mut etcd = TestEtcd::start().await;
    let cluster = cluster_name("drain-outage");
    let discovery = client(&etcd, &cluster).await;
    let d0 = discovery.register(node("d0", Role::Decode)).await.unwrap();
    let mut view = discovery.watch(Role::Decode).await.unwrap();
    wait_for(
        &mut view,
        Duration::from_secs(1),
        "d0 in view",
        |v: &NodeView| v.contains_key("d0"),
    )
    .await;

    etcd.stop();
    let refused = within(
        Duration::from_secs(5),
        "set_draining answers",
        d0.set_draining(true),
    )
    .await;
    assert!(
        refused.is_err_and(|e| e.is_retryable()),
        "set_draining with etcd down must fail retryably"
    );
    etcd.restart().await;
    wait_for(
        &mut view,
        RECOVERY,
        "draining flag written after the outage",
        |v: &NodeView| v.get("d0").is_some_and(|n| n.draining),
    )
    .await;
}

#[tokio::test]
async fn register_while_etcd_is_down_fails_retryably_and_promptly() {
    init_tracing();
    let mut etcd = TestEtcd::start().await;
    let discovery = client(&etcd, &cluster_name("down")).await;
    etcd.stop();
    let started = Instant::now();
    let result = within(
        Duration::from_secs(5),
        "register answers",
        discovery.register(node("d0", Role::Decode)),
    )
    .await;
    match result {
        Err(e) => assert!(e.is_retryable(), "{e:?} should be retryable"),
        Ok(_) => panic!("register succeeded with etcd down"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    // The same client works once etcd is back.
    etcd.restart().await;
    let registration = within(RECOVERY, "register after restart", async {
        loop {
            match discovery.register(node("d0", Role::Decode)).await {
                Ok(registration) => break registration,
                Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => panic!("{e:?}"),
            }
        }
    })
    .await;
    registration.deregister().await.unwrap();
}
