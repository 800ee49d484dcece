//! Desired pool sizes and the planner election against a real etcd.

use std::time::{Duration, Instant};

use tandem_cluster::testing::TestEtcd;
use tandem_cluster::{
    ClusterError, Election, EtcdConfig, EtcdDiscovery, PoolBounds, Role, ScaleLimits, ScaleStore,
};
use tokio_util::sync::CancellationToken;

async fn client(etcd: &TestEtcd) -> EtcdDiscovery {
    EtcdDiscovery::connect(EtcdConfig::new(vec![etcd.endpoint()], "scale-test"))
        .await
        .unwrap()
}

#[tokio::test]
async fn a_size_outside_the_limits_is_refused_and_nothing_is_written() {
    let etcd = TestEtcd::start().await;
    let store = client(&etcd).await.scale_store();
    assert_eq!(store.targets().await.unwrap().prefill, None);
    store
        .set_limits(ScaleLimits {
            prefill: PoolBounds { min: 1, max: 3 },
            decode: PoolBounds { min: 1, max: 2 },
        })
        .await
        .unwrap();
    store.set_target(Role::Prefill, 2).await.unwrap();
    for (role, n) in [(Role::Prefill, 4), (Role::Decode, 0), (Role::Decode, 3)] {
        match store.set_target(role, n).await {
            Err(ClusterError::ScaleRefused { role: r, asked, .. }) => {
                assert_eq!((r, asked), (role, n))
            }
            other => panic!("{role} = {n}: {other:?}"),
        }
    }
    let t = store.targets().await.unwrap();
    assert_eq!((t.prefill, t.decode), (Some(2), None));
    let bad = ScaleLimits {
        prefill: PoolBounds { min: 3, max: 2 },
        decode: PoolBounds { min: 1, max: 2 },
    };
    assert!(store.set_limits(bad).await.is_err());
    assert_eq!(store.limits().await.unwrap().unwrap().prefill.max, 3);
}

#[tokio::test]
async fn one_leader_at_a_time_and_a_leader_whose_lease_is_gone_stops_within_one_ttl() {
    let etcd = TestEtcd::start().await;
    let ttl = Duration::from_secs(2);
    let (a, b) = (client(&etcd).await.election(ttl), client(&etcd).await.election(ttl));
    let cancel = CancellationToken::new();
    let lead_a = a.campaign("planner-a", &cancel).await.unwrap().unwrap();
    assert!(lead_a.is_held());
    assert_eq!(a.leader().await.unwrap().as_deref(), Some("planner-a"));

    let (b2, c2) = (b.clone(), cancel.clone());
    let waiting = tokio::spawn(async move { b2.campaign("planner-b", &c2).await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!waiting.is_finished(), "a second candidate won while the first held the lease");
    assert!(lead_a.is_held(), "the leader lost its lease while renewing it");

    // Take the key away under the leader (as an expired lease would).
    let mut raw = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    raw.delete("/tandem/scale-test/planner/leader", None).await.unwrap();
    let t0 = Instant::now();
    tokio::time::timeout(ttl, lead_a.lost().cancelled())
        .await
        .expect("the leader noticed it lost the key within one TTL");
    assert!(!lead_a.is_held());
    let lead_b = tokio::time::timeout(ttl, waiting)
        .await
        .expect("the second candidate won within one TTL")
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(lead_b.is_held());
    eprintln!("handover in {:?}", t0.elapsed());

    // A resignation hands over at once.
    lead_b.resign();
    let lead_a2 = tokio::time::timeout(ttl, a.campaign("planner-a", &cancel))
        .await
        .expect("re-elected after a resignation")
        .unwrap()
        .unwrap();
    assert!(lead_a2.is_held());
}

#[tokio::test]
async fn a_leader_cut_off_from_etcd_stops_acting_within_one_ttl() {
    let mut etcd = TestEtcd::start().await;
    let ttl = Duration::from_secs(2);
    let e = client(&etcd).await.election(ttl);
    let lead = e
        .campaign("planner-a", &CancellationToken::new())
        .await
        .unwrap()
        .unwrap();
    let t0 = Instant::now();
    etcd.stop();
    while lead.is_held() {
        assert!(t0.elapsed() < ttl, "still acting {:?} after etcd went away", t0.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
