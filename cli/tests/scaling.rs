//! Pools that scale on their own, on real processes: `tandem up --autoscale` runs the planner;
//! a burst of long prompts grows the prefill pool, its end shrinks it after the cooldown, and
//! no request is lost either way. Bad sizes and bad SLO files are refused, naming what is wrong.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::load::Load;
use common::up::{SERIAL, Up, free_addr};

fn tandem(args: &[&str], etcd: &str) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .env("TANDEM_ETCD_ENDPOINTS", etcd)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// `(target, serving)` of `pool` from `tandem scale`.
fn pool(etcd: &str, pool: &str) -> (usize, usize) {
    let (ok, out, err) = tandem(&["scale"], etcd);
    assert!(ok, "{out}{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with(pool))
        .unwrap_or_else(|| panic!("no {pool} row:\n{out}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    (cols[1].parse().unwrap(), cols[2].parse().unwrap())
}

fn slo_file(dir: &std::path::Path, name: &str, text: &str) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[test]
fn bad_slo_files_are_refused_at_start_naming_the_field() {
    let dir = std::env::temp_dir().join(format!("tandem-slo-{}", std::process::id()));
    for (text, field) in [
        ("ttft_p90_slo_ms = 1000\nttft_slo = 3\n", "unknown field `ttft_slo`"),
        ("[prefill]\nmin = 3\nmax = 2\n", "`prefill.min` = 3"),
        ("[decode]\nmax = -1\n", "slo-file"),
        ("decode_kv_low = 0.95\n", "`decode_kv_low`"),
    ] {
        let f = slo_file(&dir, "bad.toml", text);
        for args in [
            vec!["planner", "--slo-file", &f, "--nats-url", "nats://127.0.0.1:1"],
            vec!["up", "--slo-file", &f, "--autoscale", "--run-dir", dir.to_str().unwrap()],
        ] {
            let (ok, out, err) = tandem(&args, "http://127.0.0.1:1");
            assert!(!ok, "{args:?} accepted {text:?}");
            assert!(err.contains(field), "{args:?} with {text:?}: {out}{err}");
            assert!(!err.contains("starting etcd") && !dir.join("logs").exists(), "started something: {err}");
        }
    }
}

#[test]
fn autoscale_grows_prefill_under_long_prompts_and_shrinks_it_after_with_nothing_lost() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (grpc, http) = (free_addr(), free_addr());
    let dir = std::env::temp_dir().join(format!("tandem-scaling-{}", std::process::id()));
    let slo = slo_file(
        &dir,
        "slo.toml",
        "ttft_p90_slo_ms = 1000\ninterval_ms = 500\n\
         [prefill]\nmin = 1\nmax = 3\nscale_up_cooldown_secs = 3\nscale_down_cooldown_secs = 8\n\
         [decode]\nmin = 1\nmax = 1\n",
    );
    let mut up = Up::start_with(
        &grpc,
        &http,
        &["--no-sample", "--autoscale", "--slo-file", &slo, "--max-prefill", "3", "--max-decode", "1"],
    );
    up.wait_for_line("Ctrl-C or SIGTERM stops the cluster", Duration::from_secs(240));
    let etcd = up.printed("etcd");
    assert_eq!(pool(&etcd, "prefill"), (1, 1));

    // By hand: sizes outside the bounds and unknown pools are refused, nothing changes.
    for (arg, why) in [
        ("prefill=9", "prefill pool size 9 refused: its limits are min 1, max 3"),
        ("decode=0", "decode pool size 0 refused"),
        ("encode=1", "unknown pool `encode`"),
    ] {
        let (ok, out, err) = tandem(&["scale", arg], &etcd);
        assert!(!ok && err.contains(why), "{arg}: {out}{err}");
    }
    assert_eq!(pool(&etcd, "prefill"), (1, 1));

    // The step: 6 clients with ~700-token prompts, two tokens each (latency ≈ TTFT).
    let long = "The harbour at dawn was quiet except for the gulls and the slow knock of hulls. "
        .repeat(45);
    let t0 = Instant::now();
    let load = Load::start(http.parse().unwrap(), 6, move |k| format!("{k}: {long}"), 2);
    let (mut grown_at, mut serving_at) = (None, None);
    while serving_at.is_none() {
        let (target, serving) = pool(&etcd, "prefill");
        if target >= 2 && grown_at.is_none() {
            grown_at = Some(t0.elapsed());
        }
        if serving >= 2 {
            serving_at = Some(t0.elapsed());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "prefill did not grow (target {target}, serving {serving}); tandem up:\n{}\nplanner:\n{}",
            up.drain_stderr(),
            std::fs::read_to_string(up.run_dir.join("logs/planner.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (grown_at, serving_at) = (grown_at.unwrap(), serving_at.unwrap());
    // Keep the load on the bigger pool a while, then drop it.
    std::thread::sleep(Duration::from_secs(10));
    let (samples, errors) = load.stop();
    let dropped_at = t0.elapsed();
    let mut shrunk_at = None;
    while shrunk_at.is_none() {
        if pool(&etcd, "prefill") == (1, 1) {
            shrunk_at = Some(t0.elapsed());
        }
        assert!(
            t0.elapsed() - dropped_at < Duration::from_secs(120),
            "prefill did not shrink back; tandem up:\n{}",
            up.drain_stderr()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let shrunk_at = shrunk_at.unwrap();
    let ok = samples.iter().filter(|s| s.ok).count();
    eprintln!(
        "scaling: load from 0 s; prefill target ≥ 2 at {:.1} s, 2 serving at {:.1} s; load dropped at {:.1} s; back to 1 at {:.1} s; {ok} requests, none failed",
        grown_at.as_secs_f64(),
        serving_at.as_secs_f64(),
        dropped_at.as_secs_f64(),
        shrunk_at.as_secs_f64()
    );
    assert!(errors.is_empty(), "requests lost or cut short: {errors:#?}");
    assert!(ok >= 6, "only {ok} requests completed");
    assert!(grown_at < Duration::from_secs(30), "the planner took {grown_at:?} to grow prefill");

    let planner = std::fs::read_to_string(up.run_dir.join("logs/planner.log")).unwrap();
    assert!(planner.contains("planner: elected; acting"), "{planner}");
    assert!(planner.contains("prompt tokens pending"), "{planner}");
    assert!(planner.contains("one node fewer clears them"), "a scale-down decision with its reason: {planner}");
    let log = up.drain_stderr();
    assert!(log.contains("started prefill-1"), "{log}");
    assert!(log.contains("drained and left"), "{log}");
    up.signal(libc::SIGTERM);
    let (code, _) = up.wait_exit(Duration::from_secs(120));
    assert_eq!(code, Some(0));
}
