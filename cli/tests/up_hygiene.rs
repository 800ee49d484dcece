//! `tandem up` leaves no process behind, however it ends: SIGTERM while the nodes are still
//! loading, SIGINT while the sample answer streams, and SIGKILL of `tandem up` itself (the
//! children's parent-death signal). Each test reads the pids `tandem up` wrote to
//! `<run-dir>/pids` and checks every one is gone. Real etcd, NATS and nodes; one at a time.

use crate::common;

use std::time::Duration;

use common::up::{GONE_WITHIN, SERIAL, Up, alive, assert_all_gone};

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
