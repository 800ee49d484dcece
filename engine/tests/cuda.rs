//! The CUDA backend against the CPU backend, on the same seeded dummy weights. Each test means
//! something with or without a GPU: without a CUDA driver it asserts the typed `NoDriver` error
//! (naming libcuda and what was tried) and prints one line saying what it did not run; with a
//! driver it runs the engine on the GPU and compares it with the CPU.
//!
//! Tolerance: f32 weights on the GPU sum in other orders (cuBLAS, RMSNorm, online softmax), so
//! logits agree within float rounding; on these weights the greedy tokens are asserted equal
//! (a divergence would be a near-tie, and is reported with both tokens). bf16 is compared for
//! agreement only (printed), not asserted.

mod common;

use std::path::PathBuf;

use common::disaggregated;
use tandem_engine::kv::KvPool;
use tandem_engine::{
    Completion, Device, Engine, EngineConfig, EngineError, KvCapacity, KvDtype, Model, ModelSource, Priority, Request,
    SamplingParams, SchedulerConfig, Staging, WeightDtype, loader,
};
use tandem_kernels_cuda::CudaError;

/// A small Llama shape with GQA (9 heads over 3 KV heads, head_dim 64: SmolLM2's attention).
const CONFIG: &str = r#"{"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 4,
    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 2048,
    "max_position_embeddings": 2048, "rope_theta": 100000.0, "tie_word_embeddings": true}"#;

/// Written once per test process: tests run in parallel, and rewriting the file while another
/// test reads it showed that test an empty file.
fn config_file() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tandem-cuda-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("config.json");
        std::fs::write(&p, CONFIG).unwrap();
        p
    })
    .clone()
}

fn load(dtype: WeightDtype) -> loader::LoadedModel {
    loader::load(&ModelSource::Dummy { config: config_file(), seed: 7 }, dtype).expect("dummy weights")
}

fn engine_config(kv_dtype: KvDtype, max_tokens_per_step: usize) -> EngineConfig {
    EngineConfig {
        block_size_tokens: 16,
        kv_dtype,
        kv_capacity: KvCapacity::Blocks(256),
        scheduler: SchedulerConfig { max_tokens_per_step, max_model_len: 2048, ..SchedulerConfig::default() },
    }
}

/// `Some(model)` on a machine with a usable GPU; `None` (after asserting the error is the typed
/// no-driver one, and printing what was not run) without a driver.
fn cuda_model(dtype: WeightDtype, what: &str) -> Option<Model> {
    match Model::on_device(load(dtype).weights, Device::Cuda(0)) {
        Ok(m) => Some(m),
        Err(EngineError::Cuda(e @ CudaError::NoDriver { .. })) => {
            let msg = e.to_string();
            assert!(msg.contains("libcuda"), "the error names the library: {msg}");
            assert!(msg.contains("tried"), "the error names what was searched: {msg}");
            eprintln!("engine cuda tests: not run on a GPU ({what}): {msg}");
            None
        }
        Err(e) => panic!("opening cuda:0 for {what}: {e}"),
    }
}

/// 8 prompts of different lengths (one shares a prefix with another), 24 greedy tokens each.
fn requests() -> Vec<Request> {
    (0..8u64)
        .map(|i| {
            let len = 5 + 13 * i as usize;
            let mut prompt: Vec<u32> = (0..len).map(|j| ((j * 31 + i as usize * 97) % 1900 + 50) as u32).collect();
            if i == 7 {
                prompt[..18].copy_from_slice(&requests_prefix());
            }
            Request {
                id: i,
                prompt,
                params: SamplingParams { ignore_eos: true, ..SamplingParams::greedy(24) },
                priority: Priority::Interactive,
            }
        })
        .collect()
}

fn requests_prefix() -> [u32; 18] {
    let mut p = [0u32; 18];
    for (j, x) in p.iter_mut().enumerate() {
        *x = ((j * 31 + 6 * 97) % 1900 + 50) as u32;
    }
    p
}

fn run(engine: &mut Engine) -> Vec<Completion> {
    engine.generate(requests(), |_| {}).expect("generate")
}

fn first_divergence(a: &[Completion], b: &[Completion]) -> Option<String> {
    a.iter().zip(b).find_map(|(x, y)| {
        let at = x.tokens.iter().zip(&y.tokens).position(|(p, q)| p != q)?;
        Some(format!("request {}: token {at}: cpu {} vs cuda {}", x.request_id, x.tokens[at], y.tokens[at]))
    })
}

#[test]
fn cuda_f32_greedy_tokens_equal_the_cpus_batched_and_chunked() {
    let Some(mut gpu) = cuda_model(WeightDtype::F32, "f32 exactness") else { return };
    assert_eq!(gpu.device(), Device::Cuda(0));
    // 48 tokens a step: prompts are chunked, and chunks share steps with decode tokens.
    for (kv, step_tokens) in [(KvDtype::F32, 48), (KvDtype::F32, 512), (KvDtype::Bf16, 512)] {
        let mut cpu = Engine::new(Model::new(load(WeightDtype::F32).weights), None, engine_config(kv, step_tokens)).unwrap();
        let mut cuda = Engine::new(gpu, None, engine_config(kv, step_tokens)).unwrap();
        assert!(cuda.kv_pool().is_none(), "a CUDA engine's KV is in device memory");
        let (c, g) = (run(&mut cpu), run(&mut cuda));
        if let Some(d) = first_divergence(&c, &g) {
            panic!("kv {kv}, {step_tokens} tokens a step: {d}");
        }
        // The decode steps (greedy: ids only) were replayed from captured graphs.
        let st = cuda.stats();
        assert!(st.cuda_graph_replays > 0 && st.cuda_graph_fallbacks == 0, "kv {kv}: {st:?}");
        drop(cuda);
        gpu = cuda_model(WeightDtype::F32, "f32 exactness").expect("the GPU opened a moment ago");
    }
}

/// Tensor parallelism on one GPU: three ranks, each a thread with its own engine holding a third
/// of the heads, KV heads and MLP features (`backend::cuda::shard`), all-reducing through host
/// memory, produce the unsharded GPU engine's greedy tokens (f32).
#[test]
fn three_tensor_parallel_ranks_on_one_gpu_equal_the_unsharded_engine() {
    use tandem_engine::backend::cuda::shard::HostAllReduce;
    let Some(gpu) = cuda_model(WeightDtype::F32, "tensor-parallel ranks") else { return };
    let mut whole = Engine::new(gpu, None, engine_config(KvDtype::F32, 48)).unwrap();
    let want = run(&mut whole);
    drop(whole);
    let ranks: Vec<_> = HostAllReduce::group(3)
        .into_iter()
        .map(|coll| {
            std::thread::spawn(move || {
                let model = Model::on_cuda_rank(load(WeightDtype::F32).weights, 0, Box::new(coll)).expect("rank");
                let mut e = Engine::new(model, None, engine_config(KvDtype::F32, 48)).unwrap();
                assert_eq!(e.kv_layout().num_kv_heads, 1, "each rank holds one of the 3 KV heads");
                run(&mut e)
            })
        })
        .collect();
    for (rank, h) in ranks.into_iter().enumerate() {
        let got = h.join().expect("a rank panicked");
        if let Some(d) = first_divergence(&want, &got) {
            panic!("rank {rank} of 3 against the unsharded engine: {d}");
        }
    }
    let uneven = tandem_engine::backend::cuda::shard::Shard::new(0, 2, &load(WeightDtype::F32).weights.config);
    assert!(uneven.is_err(), "2 ranks cannot split 9 heads");
}

#[test]
fn cuda_bf16_runs_and_reports_its_agreement_with_the_cpu() {
    let Some(gpu) = cuda_model(WeightDtype::Bf16, "bf16 agreement") else { return };
    let mut cuda = Engine::new(gpu, None, engine_config(KvDtype::Bf16, 512)).unwrap();
    let mut cpu = Engine::new(Model::new(load(WeightDtype::Bf16).weights), None, engine_config(KvDtype::Bf16, 512)).unwrap();
    let (c, g) = (run(&mut cpu), run(&mut cuda));
    assert!(g.iter().all(|x| x.tokens.len() == 24));
    let same: usize = c.iter().zip(&g).map(|(x, y)| x.tokens.iter().zip(&y.tokens).take_while(|(p, q)| p == q).count()).sum();
    eprintln!(
        "engine cuda tests: bf16 weights, bf16 KV: {same} of {} greedy tokens agree with the CPU before the first divergence ({})",
        24 * c.len(),
        first_divergence(&c, &g).unwrap_or_else(|| "none".into())
    );
}

#[test]
fn a_cuda_model_refuses_host_kv_int8_kv_and_weights_without_a_gpu_kernel() {
    let Some(gpu) = cuda_model(WeightDtype::F32, "refusals") else { return };
    let cfg = engine_config(KvDtype::F32, 512);
    let (layout, n) = Engine::pool_shape(&gpu, &cfg).unwrap();
    let pool = KvPool::new(layout, n).unwrap();
    match Engine::with_pool(gpu, None, cfg, pool) {
        Err(e @ EngineError::InvalidConfig { field: "kv_pool", .. }) => {
            assert!(e.to_string().contains("with_staged_pool"), "{e}")
        }
        Err(e) => panic!("expected InvalidConfig(kv_pool), got {e}"),
        Ok(_) => panic!("a CUDA model's KV in host memory must be refused"),
    }
    let gpu = cuda_model(WeightDtype::F32, "refusals").unwrap();
    match Engine::new(gpu, None, engine_config(KvDtype::Int8, 512)) {
        Err(EngineError::Cuda(CudaError::Unsupported { .. })) => {}
        Err(e) => panic!("expected Cuda(Unsupported), got {e}"),
        Ok(_) => panic!("int8 KV on CUDA must be refused"),
    }
    match Model::on_device(load(WeightDtype::Q8_0).weights, Device::Cuda(0)) {
        Err(EngineError::InvalidConfig { field: "dtype", .. }) => {}
        Err(e) => panic!("expected InvalidConfig(dtype), got {e}"),
        Ok(_) => panic!("q8_0 weights have no GPU kernel"),
    }
}

#[test]
fn cuda_steps_that_need_the_rows_bring_them_back_and_greedy_ones_only_ids() {
    // A step whose every sequence is plain greedy picks its tokens on the device; one with a
    // request that wants log probabilities brings the logits back. Both give the CPU's tokens.
    let Some(gpu) = cuda_model(WeightDtype::F32, "device argmax and rows") else { return };
    let cfg = || engine_config(KvDtype::F32, 512);
    let mut cuda = Engine::new(gpu, None, cfg()).unwrap();
    let mut cpu = Engine::new(Model::new(load(WeightDtype::F32).weights), None, cfg()).unwrap();
    let mut reqs = requests();
    for r in reqs.iter_mut().step_by(3) {
        r.params.logprobs = true;
    }
    let (c, g) = (cpu.generate(reqs.clone(), |_| {}).unwrap(), cuda.generate(reqs, |_| {}).unwrap());
    if let Some(d) = first_divergence(&c, &g) {
        panic!("mixed greedy and logprobs batch: {d}");
    }
}

/// The 8 prompts sampled: temperatures 0.7 / 1.0 / 1.3, top-p 0.9 on half, top-k 40 on a
/// quarter, each its own seed; the first one also wants log probabilities when asked.
fn sampled_requests(logprobs_on_first: bool) -> Vec<Request> {
    let mut reqs = requests();
    for (i, r) in reqs.iter_mut().enumerate() {
        r.params.temperature = [0.7, 1.0, 1.3][i % 3];
        r.params.top_p = if i % 2 == 0 { 0.9 } else { 1.0 };
        r.params.top_k = if i % 4 == 1 { 40 } else { 0 };
        r.params.seed = Some(1000 + i as u64);
        r.params.logprobs = logprobs_on_first && i == 0;
    }
    reqs
}

#[test]
fn cuda_sampling_on_the_device_picks_the_hosts_tokens() {
    // Sampled requests with nothing else to compute pick their tokens on the device. With one
    // request wanting log probabilities, every step brings its rows back and the host samples
    // them all. The streams must be the same, token for token: the device's pick is the host
    // sampler's (tandem-kernels `sample`), and the draws are the requests' own.
    let cfg = || engine_config(KvDtype::F32, 512);
    let Some(gpu) = cuda_model(WeightDtype::F32, "device sampling") else { return };
    let mut cuda = Engine::new(gpu, None, cfg()).unwrap();
    let on_device = cuda.generate(sampled_requests(false), |_| {}).unwrap();
    let st = cuda.stats();
    assert_eq!(st.tokens_picked_on_device, st.decode_tokens, "every token picked on the device: {st:?}");
    assert!(st.cuda_graph_replays > 0 && st.cuda_graph_fallbacks == 0, "sampling decode steps replay graphs: {st:?}");
    drop(cuda);
    let gpu = cuda_model(WeightDtype::F32, "device sampling").expect("the GPU opened a moment ago");
    let mut cuda = Engine::new(gpu, None, cfg()).unwrap();
    let on_host = cuda.generate(sampled_requests(true), |_| {}).unwrap();
    assert_eq!(cuda.stats().tokens_picked_on_device, 0, "a logprobs row in every step: the host samples");
    if let Some(d) = first_divergence(&on_host, &on_device) {
        panic!("sampled on the host vs on the device (same GPU logits): {d}");
    }
    // Beside it, for the record: the CPU engine's f32 logits differ from the GPU's in the last
    // bits, so a draw that lands on a boundary may pick differently; say where.
    let mut cpu = Engine::new(Model::new(load(WeightDtype::F32).weights), None, cfg()).unwrap();
    let on_cpu = cpu.generate(sampled_requests(false), |_| {}).unwrap();
    match first_divergence(&on_cpu, &on_device) {
        None => eprintln!("engine cuda tests: sampled streams equal the CPU engine's (8 x 24 tokens)"),
        Some(d) => eprintln!("engine cuda tests: sampled streams first differ from the CPU engine's at {d}"),
    }
}

#[test]
fn a_cpu_engine_keeps_its_kv_in_host_memory() {
    // CPU side only: a CPU model's KV store is host memory, and the engine says so.
    let cpu = Model::new(load(WeightDtype::F32).weights);
    assert_eq!(cpu.device(), Device::Cpu);
    let e = Engine::new(cpu, None, engine_config(KvDtype::F32, 512)).unwrap();
    assert!(e.kv_pool().is_some());
    assert_eq!(e.device(), Device::Cpu);
}

#[test]
fn cuda_staged_prefill_and_decode_equal_the_colocated_gpu_engine() {
    // Item 3's staged path on one GPU: a prefill engine copies its KV out to a page-locked host
    // mirror layer by layer, the bytes move host to host (the transport's part), and a decode
    // engine copies them up before decoding. Each request runs alone on both sides, so the GPU
    // computes the same shapes and the tokens are equal, not merely close.
    let Some(gpu) = cuda_model(WeightDtype::F32, "staged disaggregation") else { return };
    let cfg = || engine_config(KvDtype::F32, 512);
    let staged = |model: Model, staging: Staging| {
        let (layout, n) = Engine::pool_shape(&model, &cfg()).unwrap();
        Engine::with_staged_pool(model, None, cfg(), KvPool::new(layout, n).unwrap(), staging).unwrap()
    };
    let mut colocated = Engine::new(gpu, None, cfg()).unwrap();
    let mut prefill = staged(cuda_model(WeightDtype::F32, "staged").unwrap(), Staging::Push);
    let mut decode = staged(cuda_model(WeightDtype::F32, "staged").unwrap(), Staging::Receive);
    let mut same = 0;
    for req in requests() {
        let want = colocated.generate(vec![req.clone()], |_| {}).unwrap().remove(0).tokens;
        let got = disaggregated(&mut prefill, &mut decode, req.clone());
        assert_eq!(got, want, "request {}", req.id);
        same += 1;
    }
    let (ps, ds) = (prefill.stats(), decode.stats());
    assert!(ps.kv_staged_out_bytes > 0 && ds.kv_staged_in_bytes > 0, "{ps:?} {ds:?}");
    eprintln!(
        "engine cuda tests: staged split equals the colocated GPU engine on {same} requests; \
         {} B out, {} B in, mirrors page-locked: {} / {}",
        ps.kv_staged_out_bytes, ds.kv_staged_in_bytes, ps.kv_mirror_pinned, ds.kv_mirror_pinned
    );
}
