//! The simulation against what it must show: latencies that match the roofline when nothing
//! queues, conservation of requests, determinism, prefill interference when colocated, and the
//! real planner moving GPUs to the pool that is short.

use tandem_planner::{PlannerConfig, PoolLimits};
use tandem_sim::{Arrivals, Gpu, Lengths, Mode, ModelShape, Roofline, Sim, SimConfig, compare};

fn cfg(gpus: u32, rate: f64, prompt: u32, output: u32, duration_s: f64) -> SimConfig {
    SimConfig {
        gpus,
        roofline: Roofline { model: ModelShape::seed_70b(), gpu: Gpu::h200(), tp: 8 },
        duration_s,
        arrivals: Arrivals::Poisson { rate },
        lengths: Lengths { prompt, output, spread: 0.0 },
        seed: 3,
        mode: Mode::Disaggregated { prefill: 1 },
        max_batch: 256,
        max_tokens_per_step: 8192,
        ttft_slo_s: 1.0,
        tpot_slo_s: 0.05,
        planner: None,
        warmup_s: 60.0,
        gpu_hour_usd: 3.5,
        sample_s: 30.0,
        measured: None,
    }
}

fn within(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= tol * want
}

#[test]
fn at_low_load_ttft_and_itl_are_the_rooflines_prefill_and_decode_step() {
    let c = cfg(16, 1.0, 1000, 100, 900.0);
    let r = c.roofline;
    let rep = Sim::new(c).run();
    let prefill = r.prefill_chunk_s(0.0, 1000.0);
    let step = r.decode_step_s(1.0, 1050.0);
    assert!(within(rep.ttft_s.p50, prefill, 0.05), "TTFT p50 {} vs prefill {prefill}", rep.ttft_s.p50);
    assert!(within(rep.itl_s.p50, step, 0.10), "ITL p50 {} vs step {step}", rep.itl_s.p50);
    assert!(rep.slo_attainment > 0.99, "{rep:?}");
    // Conservation: every arrival completed or is still in flight at the end (a few seconds' worth).
    assert!(rep.arrived >= rep.completed && rep.arrived - rep.completed <= 5, "{} / {}", rep.arrived, rep.completed);
    assert_eq!(rep.rejected, 0);
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let mut a = Sim::new(cfg(32, 20.0, 1500, 200, 120.0)).run();
    let mut b = Sim::new(cfg(32, 20.0, 1500, 200, 120.0)).run();
    (a.wall_s, b.wall_s) = (0.0, 0.0);
    assert_eq!(a, b);
}

#[test]
fn colocated_prefill_chunks_stall_decodes_and_disaggregation_does_not() {
    let mut c = cfg(64, 0.0, 1792, 256, 300.0);
    c.lengths.spread = 0.5;
    c.arrivals = Arrivals::Poisson { rate: 0.7 * c.capacity_rps() };
    c.mode = Mode::Colocated;
    let cmp = compare(&c).unwrap();
    let (d, k) = (&cmp.disaggregated, &cmp.colocated);
    // A colocated step that carries a full prefill chunk takes ~8,192 tokens of compute.
    assert!(k.itl_s.p99 > 5.0 * d.itl_s.p99, "ITL p99 colocated {} vs disaggregated {}", k.itl_s.p99, d.itl_s.p99);
    assert!(d.goodput_rps > k.goodput_rps, "goodput {} vs {}", d.goodput_rps, k.goodput_rps);
    assert!(d.gpu_hours > 0.0 && (d.gpu_hours - k.gpu_hours).abs() < 0.01 * k.gpu_hours);
}

#[test]
fn the_planner_moves_gpus_to_the_short_pool_within_the_cap() {
    // 16 instances, 14 of them prefill: decode is short. The planner shrinks idle prefill and
    // grows decode into the room it leaves.
    let mut c = cfg(128, 0.0, 1000, 400, 1500.0);
    c.mode = Mode::Disaggregated { prefill: 14 };
    c.arrivals = Arrivals::Poisson { rate: 0.6 * c.capacity_rps() };
    let limits = PoolLimits { min: 1, max: 15, scale_up_cooldown_secs: 10, scale_down_cooldown_secs: 30 };
    // The prefill throughput profile from the roofline (as `tandem bench-engine` gives it for
    // a real node): measured figures of mostly idle nodes would understate it.
    let profile = 1000.0 / c.roofline.prefill_chunk_s(0.0, 1000.0);
    c.planner = Some(PlannerConfig {
        prefill_tokens_per_s: profile,
        // Prefill runs ~40 % busy here (at decode's pace): let it give up nodes below 60 %.
        prefill_util_low: 0.6,
        interval_ms: 5000,
        itl_p90_slo_ms: 30,
        prefill: limits,
        decode: limits,
        ..PlannerConfig::default()
    });
    let rep = Sim::new(c).run();
    let (first, last) = (rep.timeline.first().unwrap(), rep.timeline.last().unwrap());
    assert!(rep.planner_decisions >= 2, "{rep:#?}");
    assert!(last.decode_gpus > first.decode_gpus, "decode {} → {}", first.decode_gpus, last.decode_gpus);
    assert!(last.prefill_gpus < first.prefill_gpus, "prefill {} → {}", first.prefill_gpus, last.prefill_gpus);
    assert!(rep.timeline.iter().all(|s| s.prefill_gpus + s.decode_gpus + s.warming_gpus <= 128));
}

#[test]
fn settings_the_simulation_cannot_run_are_refused_naming_the_flag() {
    let mut c = cfg(8, 1.0, 100, 10, 10.0);
    assert!(c.validate().unwrap_err().to_string().contains("`gpus`"));
    c.gpus = 16;
    c.roofline.tp = 1; // 141 GB of weights on one 141 GB GPU: no room for KV
    c.gpus = 2;
    assert!(c.validate().unwrap_err().to_string().contains("`tp`"));
    let mut c = cfg(16, -1.0, 100, 10, 10.0);
    assert!(c.validate().unwrap_err().to_string().contains("`rate`"));
    c.arrivals = Arrivals::Bursty { rate: 1.0, high: 5.0, period_s: 60.0, duty: 0.5 };
    assert!(c.validate().unwrap_err().to_string().contains("`burst`"));
}

#[test]
fn a_closed_loop_keeps_each_client_to_one_request_at_a_time_and_more_clients_batch_and_wait() {
    let closed = |clients: u32| {
        let mut c = cfg(16, 0.0, 1000, 100, 300.0);
        c.arrivals = Arrivals::Closed { clients };
        c.validate().unwrap();
        Sim::new(c).run()
    };
    let one = closed(1);
    let r = cfg(16, 0.0, 1000, 100, 300.0).roofline;
    // One client: every request alone, so the roofline's prefill and decode step, back to back.
    let prefill = r.prefill_chunk_s(0.0, 1000.0);
    let step = r.decode_step_s(1.0, 1050.0);
    assert!(within(one.ttft_s.p50, prefill, 0.05), "TTFT p50 {} vs prefill {prefill}", one.ttft_s.p50);
    assert!(within(one.itl_s.p50, step, 0.10), "ITL p50 {} vs step {step}", one.itl_s.p50);
    // Never more than one in flight: it arrives only when the last one completed.
    assert!(one.arrived - one.completed <= 1, "{} arrived, {} completed", one.arrived, one.completed);
    let per_request = prefill + 99.0 * step;
    let expected = 300.0 / per_request;
    assert!(within(one.completed as f64, expected, 0.10), "{} completed, ~{expected:.0} expected", one.completed);
    // Eight clients on one prefill instance: the first eight prompts arrive together and wait
    // for each other, and the decode batch grows, so latencies rise while throughput does too.
    let eight = closed(8);
    assert!(eight.arrived - eight.completed <= 8, "{} arrived, {} completed", eight.arrived, eight.completed);
    assert!(eight.ttft_s.p99 > one.ttft_s.p99, "{} vs {}", eight.ttft_s.p99, one.ttft_s.p99);
    assert!(eight.itl_s.p50 >= one.itl_s.p50, "{} vs {}", eight.itl_s.p50, one.itl_s.p50);
    assert!(eight.completed > 4 * one.completed, "{} vs {}", eight.completed, one.completed);
    let mut none = cfg(16, 0.0, 1000, 100, 300.0);
    none.arrivals = Arrivals::Closed { clients: 0 };
    assert!(none.validate().is_err(), "no clients");
}
