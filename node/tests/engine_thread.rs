//! The engine actor with a tiny seeded dummy model: commands and steps run on the dedicated
//! thread, the loop steps until idle then blocks, snapshots follow, shutdown and driver panics
//! end the thread cleanly, and build errors come back from `spawn`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tandem_engine::{
    Engine, EngineConfig, EngineError, KvCapacity, KvDtype, Model, ModelSource, Request,
    SamplingParams, WeightDtype, loader,
};
use tandem_node::NodeError;
use tandem_node::engine_thread::{self, Driver};
use tokio::sync::oneshot;

fn tiny_engine() -> Engine {
    // One directory per call: tests run in parallel threads, and a shared config.json could be
    // read while another test rewrites it (seen: "EOF while parsing" on a cold CI run).
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tandem-node-dummy-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 512}"#,
    )
    .unwrap();
    let l = loader::load(
        &ModelSource::Dummy {
            config: cfg,
            seed: 3,
        },
        WeightDtype::F32,
    )
    .unwrap();
    let cfg = EngineConfig {
        kv_dtype: KvDtype::F32,
        kv_capacity: KvCapacity::Blocks(32),
        ..EngineConfig::default()
    };
    Engine::new(Model::new(l.weights), None, cfg).unwrap()
}

enum Cmd {
    Generate {
        id: u64,
        tokens: usize,
        done: oneshot::Sender<(Vec<u32>, String)>,
    },
    Panic,
}

/// A request's id, where to send (its tokens, the thread that stepped it), and its tokens so far.
type Waiting = (u64, oneshot::Sender<(Vec<u32>, String)>, Vec<u32>);

#[derive(Default)]
struct TestDriver {
    waiting: Vec<Waiting>,
    steps: Arc<AtomicUsize>,
    shutdowns: Arc<AtomicUsize>,
}

impl Driver for TestDriver {
    type Command = Cmd;

    fn on_command(&mut self, engine: &mut Engine, cmd: Cmd) {
        match cmd {
            Cmd::Generate { id, tokens, done } => {
                let params = SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(tokens)
                };
                let req = Request {
                    id,
                    prompt: vec![1, 2, 3, 4, 5],
                    params,
                    priority: Default::default(),
                };
                engine.add_request(req, Instant::now()).unwrap();
                self.waiting.push((id, done, Vec::new()));
            }
            Cmd::Panic => panic!("driver bug"),
        }
    }

    fn step(&mut self, engine: &mut Engine) -> Result<usize, EngineError> {
        self.steps.fetch_add(1, Ordering::Relaxed);
        let outs = engine.step()?;
        for o in &outs {
            let w = self
                .waiting
                .iter_mut()
                .find(|w| w.0 == o.request_id)
                .unwrap();
            w.2.push(o.token);
            if o.finished.is_some() {
                let i = self
                    .waiting
                    .iter()
                    .position(|w| w.0 == o.request_id)
                    .unwrap();
                let (_, done, tokens) = self.waiting.swap_remove(i);
                let thread = std::thread::current()
                    .name()
                    .unwrap_or_default()
                    .to_string();
                let _ = done.send((tokens, thread));
            }
        }
        Ok(outs.len())
    }

    fn housekeeping(&mut self, _: &mut Engine) {}

    fn on_step_error(&mut self, _: &mut Engine, e: &EngineError) {
        panic!("unexpected step error {e}");
    }

    fn shutdown(&mut self, _: &mut Engine) {
        self.shutdowns.fetch_add(1, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_run_on_the_engine_thread_and_it_idles_then_shuts_down_cleanly() {
    let (steps, shutdowns) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let driver = TestDriver {
        waiting: Vec::new(),
        steps: Arc::clone(&steps),
        shutdowns: Arc::clone(&shutdowns),
    };
    let (engine, blocks) = engine_thread::spawn("test-engine", 4, move |_| {
        let e = tiny_engine();
        let blocks = e.scheduler().blocks().num_blocks();
        Ok((e, driver, blocks))
    })
    .await
    .unwrap();
    assert_eq!(blocks, 32);
    let (a, b) = (oneshot::channel(), oneshot::channel());
    engine
        .send(Cmd::Generate {
            id: 1,
            tokens: 6,
            done: a.0,
        })
        .await
        .unwrap();
    engine
        .send(Cmd::Generate {
            id: 2,
            tokens: 3,
            done: b.0,
        })
        .await
        .unwrap();
    let (ta, thread) = a.1.await.unwrap();
    let (tb, _) = b.1.await.unwrap();
    assert_eq!((ta.len(), tb.len()), (6, 3));
    assert_eq!(
        thread, "test-engine",
        "steps run on the dedicated thread, not a tokio worker"
    );
    let mut snap = engine.snapshot();
    // `is_ok()` drops the borrow at once: a held `watch::Ref` would stall the engine thread.
    let quiet = tokio::time::timeout(
        Duration::from_secs(5),
        snap.wait_for(|s| s.is_quiescent() && s.total_blocks == 32),
    )
    .await
    .is_ok();
    assert!(quiet, "the snapshot shows every block free once idle");
    // Idle: the loop blocks on the channel, it does not spin through empty steps.
    let before = steps.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(steps.load(Ordering::Relaxed), before, "no steps while idle");
    engine.shutdown().await;
    assert_eq!(
        shutdowns.load(Ordering::Relaxed),
        1,
        "the driver ends its requests at shutdown"
    );
    assert!(matches!(
        engine.send(Cmd::Panic).await,
        Err(NodeError::EngineStopped)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_driver_stops_the_thread_and_callers_get_engine_stopped() {
    let shutdowns = Arc::new(AtomicUsize::new(0));
    let driver = TestDriver {
        shutdowns: Arc::clone(&shutdowns),
        ..Default::default()
    };
    let (engine, ()) = engine_thread::spawn("test-engine-panic", 4, move |_| {
        Ok((tiny_engine(), driver, ()))
    })
    .await
    .unwrap();
    engine.send(Cmd::Panic).await.unwrap();
    let (tx, rx) = oneshot::channel();
    let later = engine
        .send(Cmd::Generate {
            id: 1,
            tokens: 2,
            done: tx,
        })
        .await;
    // Either the send already fails or the reply never comes: the thread is gone.
    if later.is_ok() {
        assert!(rx.await.is_err(), "a stopped engine never replies");
    }
    engine.shutdown().await;
    assert_eq!(
        shutdowns.load(Ordering::Relaxed),
        1,
        "the driver still ends its requests after a panic"
    );
}

#[tokio::test]
async fn a_build_error_comes_back_from_spawn() {
    let r = engine_thread::spawn::<TestDriver, (), _>("test-engine-fail", 4, |_| {
        Err(NodeError::InvalidConfig {
            flag: "--model",
            value: "x".into(),
            reason: "test".into(),
        })
    })
    .await;
    assert!(matches!(
        r,
        Err(NodeError::InvalidConfig {
            flag: "--model",
            ..
        })
    ));
}
