//! deploy/runbooks/pool-scaling.md, run: every `sh` block, in order, against a local
//! autoscaling cluster (`tandem up --autoscale`) serving steady traffic. A failing command fails
//! the test, and so does any request lost or cut short while the runbook resizes, drains and
//! replaces nodes, or a planner handover that the planners' metrics do not show (the new one
//! waits, the old one stops, the new one leads and acts). The runbook binds no fixed port.

use crate::common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::load::Load;
use common::up::{SERIAL, Up, free_addr};

/// The runbook's `sh` blocks, in order.
fn sh_blocks(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut block: Option<String> = None;
    for line in markdown.lines() {
        match (&mut block, line.trim_end()) {
            (None, "```sh") => block = Some(String::new()),
            (Some(b), "```") => {
                out.push(std::mem::take(b));
                block = None;
            }
            (Some(b), l) => {
                b.push_str(l);
                b.push('\n');
            }
            (None, _) => {}
        }
    }
    out
}

#[test]
fn every_command_of_the_pool_scaling_runbook_works_on_a_serving_cluster_and_loses_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let runbook = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/runbooks/pool-scaling.md");
    let blocks = sh_blocks(&std::fs::read_to_string(&runbook).unwrap());
    assert!(blocks.len() >= 6, "the runbook's sh blocks: {blocks:#?}");

    let (grpc, http) = (free_addr(), free_addr());
    // An autoscaling cluster, so the runbook's planner handover meets a planner that acts. Its
    // SLOs are loose and its cooldowns long: it holds the sizes the runbook sets rather than
    // answering this 2-core machine's latencies.
    let slo = std::env::temp_dir().join(format!("tandem-runbook-slo-{}.toml", std::process::id()));
    std::fs::write(
        &slo,
        "ttft_p90_slo_ms = 600000\nitl_p90_slo_ms = 600000\n\
         [prefill]\nmax = 4\nscale_down_cooldown_secs = 3600\n\
         [decode]\nmax = 4\nscale_down_cooldown_secs = 3600\n",
    )
    .unwrap();
    let slo_arg = slo.to_str().unwrap();
    let mut up = Up::start_with(&grpc, &http, &["--no-sample", "--autoscale", "--slo-file", slo_arg]);
    up.wait_for_line("Ctrl-C or SIGTERM stops the cluster", Duration::from_secs(240));
    let (etcd, nats) = (up.printed("etcd"), up.printed("NATS"));
    // The old planner leads before the runbook starts its successor.
    let old_planner = up.printed("planner");
    let leads = |url: &str, want: &str| {
        let t0 = Instant::now();
        loop {
            let out = Command::new("curl").args(["-sf", url]).output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if text.lines().any(|l| l == format!("tandem_planner_leader {want}")) {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "{url}: not tandem_planner_leader {want}:\n{text}");
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    leads(&old_planner, "1");
    let load_started = Instant::now();
    let load = Load::start(
        http.parse().unwrap(),
        2,
        |k| format!("Client {k}: tell a short story about a lighthouse keeper"),
        16,
    );
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_tandem")).parent().unwrap().to_path_buf();
    let tmp = up.run_dir.join("runbook-tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap());

    let mut groups = Vec::new();
    let mut transcript = String::new();
    for (i, block) in blocks.iter().enumerate() {
        let t0 = Instant::now();
        let mut cmd = Command::new("bash");
        cmd.args(["-euo", "pipefail", "-c", block])
            .env("PATH", &path)
            .env("TANDEM_ETCD_ENDPOINTS", &etcd)
            .env("TANDEM_NATS_URL", &nats)
            .env("TANDEM_CLUSTER", "local")
            .env("TANDEM_HTTP", &http)
            .env("TANDEM_RUN_DIR", &up.run_dir)
            .env("TMPDIR", &tmp)
            .env_remove("RUST_LOG")
            .process_group(0);
        let child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        groups.push(child.id() as i32);
        let out = child.wait_with_output().unwrap();
        let text = format!(
            "--- block {i} ({:.1} s) ---\n{block}--- stdout ---\n{}--- stderr ---\n{}",
            t0.elapsed().as_secs_f64(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{text}");
        transcript.push_str(&text);
        assert!(
            out.status.success(),
            "runbook block {i} failed ({}):\n{text}\n--- tandem up ---\n{}",
            out.status,
            up.drain_stderr()
        );
    }
    // Background processes a block started (the new planner) go with their block's group.
    for g in groups {
        // SAFETY: kill(2) on a process group this test created.
        unsafe { libc::kill(-g, libc::SIGTERM) };
    }

    let ran = load_started.elapsed();
    let (samples, errors) = load.stop();
    let ok = samples.iter().filter(|s| s.ok).count();
    assert!(errors.is_empty(), "requests lost or cut short: {errors:#?}");
    // Traffic flowed throughout, not just at the start. How many complete depends on the
    // machine: a run whose 2 cores were shared with other builds completed 18.
    assert!(ok >= 6, "only {ok} requests completed during the runbook");
    assert!(
        samples.iter().any(|s| s.ok && s.at > ran / 2),
        "no request completed in the second half of the runbook ({ran:?}): {samples:#?}"
    );

    // What the runbook did, as tandem up saw it.
    let log = up.drain_stderr();
    assert!(log.contains("prefill pool: 1 → 2"), "{log}");
    assert!(log.contains("started prefill-1"), "{log}");
    // Every node drained by the runbook left and was replaced (a quick drain is over before
    // tandem up sees the node `draining`: then it sees it leave).
    for node in ["prefill-1", "prefill-0", "decode-0"] {
        assert!(
            log.contains(&format!("{node} drained and left"))
                || log.contains(&format!("{node} left the cluster (exit 0)")),
            "the runbook replaced {node}:\n{log}"
        );
    }
    assert!(!log.contains("will be replaced"), "a node died: {log}");
    // The handover, by the planners' own metrics: the new planner waited while the old one
    // acted, took over by the election once it was stopped, and ran rounds as the leader.
    let waited = transcript.find("tandem_planner_leader 0").expect("the new planner waited");
    let led = transcript.rfind("tandem_planner_leader 1").expect("the new planner leads");
    assert!(waited < led, "{transcript}");
    let rounds: u64 = transcript
        .lines()
        .filter_map(|l| l.strip_prefix("tandem_planner_rounds_total "))
        .filter_map(|n| n.trim().parse().ok())
        .next_back()
        .expect("the new planner's rounds");
    assert!(rounds >= 1, "{transcript}");
    let old_pid = up.pids().into_iter().find(|(n, _)| n == "planner").map(|(_, p)| p).unwrap();
    // SAFETY: kill(2) with signal 0 only asks whether the process exists.
    let old_alive = unsafe { libc::kill(old_pid, 0) } == 0
        && !std::fs::read_to_string(format!("/proc/{old_pid}/stat")).is_ok_and(|s| s.contains(") Z "));
    assert!(!old_alive, "the old planner (pid {old_pid}) still runs");
    let _ = std::fs::remove_file(&slo);
    assert!(transcript.contains("pool     desired  serving"), "{transcript}");
    eprintln!("runbook: {ok} requests completed, none lost");
    up.signal(libc::SIGTERM);
    let (code, _) = up.wait_exit(Duration::from_secs(120));
    assert_eq!(code, Some(0));
}
