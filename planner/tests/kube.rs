//! The Kubernetes executor against a fake API server on 127.0.0.1:0 that speaks the real
//! shapes: `GET`/`PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale` answering an
//! `autoscaling/v1 Scale` (spec.replicas omitted when zero, as the API server does), merge
//! patches only, and `v1 Status` bodies for errors (403 Forbidden, 500 InternalError, 404).
//! Every request is recorded, so the tests check paths, bodies and what was *not* sent.

use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tandem_cluster::{MemoryScaleStore, Role, ScaleStore};
use tandem_planner::{KubeExecutor, KubeExecutorConfig, PlannerError, PlannerMetrics, PoolOutcome};
use tokio_util::sync::CancellationToken;

const NS: &str = "tandem-test";
const SCALE_PREFILL: &str = "/apis/apps/v1/namespaces/tandem-test/deployments/tandem-prefill/scale";
const SCALE_DECODE: &str = "/apis/apps/v1/namespaces/tandem-test/deployments/tandem-decode/scale";

/// One request as the fake server saw it.
#[derive(Clone, Debug)]
struct Seen {
    method: Method,
    path: String,
    query: String,
    content_type: String,
    body: Option<Value>,
    at: Instant,
}

#[derive(Default)]
struct ApiState {
    /// Deployment name → spec.replicas.
    replicas: BTreeMap<String, i32>,
    /// (method, name) → statuses to answer before serving normally.
    failures: BTreeMap<(Method, String), VecDeque<u16>>,
    seen: Vec<Seen>,
}

#[derive(Clone, Default)]
struct FakeApi(Arc<Mutex<ApiState>>);

impl FakeApi {
    fn with(deployments: &[(&str, i32)]) -> Self {
        let api = FakeApi::default();
        for (name, n) in deployments {
            api.state().replicas.insert((*name).to_string(), *n);
        }
        api
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ApiState> {
        self.0.lock().unwrap()
    }

    fn fail(&self, method: Method, name: &str, statuses: &[u16]) {
        self.state().failures.insert((method, name.into()), statuses.iter().copied().collect());
    }

    fn replicas(&self, name: &str) -> i32 {
        self.state().replicas[name]
    }

    fn seen(&self) -> Vec<Seen> {
        self.state().seen.clone()
    }

    fn patches(&self, path: &str) -> Vec<Seen> {
        self.seen().into_iter().filter(|s| s.method == Method::PATCH && s.path == path).collect()
    }

    /// Serves on 127.0.0.1:0; returns the base URL.
    async fn serve(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new()
            .route(
                "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale",
                axum::routing::get(scale).patch(scale),
            )
            .fallback(unknown)
            .with_state(self.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        format!("http://{addr}")
    }
}

fn status(code: u16, reason: &str, message: String, name: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason,
        "details": { "name": name, "group": "apps", "kind": "deployments" }, "code": code,
    });
    (StatusCode::from_u16(code).unwrap(), axum::Json(body)).into_response()
}

fn scale_body(ns: &str, name: &str, replicas: i32) -> Value {
    // The API server omits spec.replicas when it is zero (omitempty).
    let spec = if replicas == 0 { json!({}) } else { json!({ "replicas": replicas }) };
    json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": name, "namespace": ns, "uid": "5b4c0a4e-2c1d-4f7e-9a51-0d3c6c9f0a11",
            "resourceVersion": "4711", "creationTimestamp": "2026-12-01T00:00:00Z",
        },
        "spec": spec,
        "status": { "replicas": replicas, "selector": format!("app.kubernetes.io/name={name}") },
    })
}

async fn scale(
    State(api): State<FakeApi>,
    method: Method,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let content_type =
        headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let path = format!("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale");
    let mut s = api.state();
    s.seen.push(Seen {
        method: method.clone(),
        path,
        query: query.unwrap_or_default(),
        content_type: content_type.clone(),
        body: serde_json::from_slice(&body).ok(),
        at: Instant::now(),
    });
    if let Some(code) =
        s.failures.get_mut(&(method.clone(), name.clone())).and_then(VecDeque::pop_front)
    {
        return match code {
            403 => status(
                403,
                "Forbidden",
                format!(
                    "deployments.apps \"{name}\" is forbidden: User \"system:serviceaccount:{ns}:tandem-planner\" \
                     cannot {} resource \"deployments/scale\" in API group \"apps\" in the namespace \"{ns}\"",
                    method.as_str().to_lowercase()
                ),
                &name,
            ),
            _ => status(
                code,
                "InternalError",
                "Internal error occurred: etcdserver: request timed out".into(),
                &name,
            ),
        };
    }
    let Some(&current) = s.replicas.get(&name) else {
        return status(404, "NotFound", format!("deployments.apps \"{name}\" not found"), &name);
    };
    if method == Method::GET {
        return axum::Json(scale_body(&ns, &name, current)).into_response();
    }
    // PATCH: a merge patch of spec.replicas, nothing else.
    if content_type != "application/merge-patch+json" {
        return status(
            415,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format: {content_type}"),
            &name,
        );
    }
    let patch: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return status(400, "BadRequest", e.to_string(), &name),
    };
    let Some(n) = patch.pointer("/spec/replicas").and_then(Value::as_i64) else {
        return status(422, "Invalid", format!("no spec.replicas in {patch}"), &name);
    };
    if patch != json!({ "spec": { "replicas": n } }) {
        return status(422, "Invalid", format!("unexpected fields in {patch}"), &name);
    }
    s.replicas.insert(name.clone(), n as i32);
    axum::Json(scale_body(&ns, &name, n as i32)).into_response()
}

async fn unknown(State(api): State<FakeApi>, method: Method, uri: axum::http::Uri) -> Response {
    api.state().seen.push(Seen {
        method,
        path: uri.path().to_string(),
        query: uri.query().unwrap_or("").into(),
        content_type: String::new(),
        body: None,
        at: Instant::now(),
    });
    status(404, "NotFound", format!("the server could not find the requested resource ({uri})"), "")
}

fn config(fast: bool) -> KubeExecutorConfig {
    let mut c = KubeExecutorConfig::new(NS);
    if fast {
        c.interval = Duration::from_millis(20);
        c.retry_min = Duration::from_millis(150);
        c.retry_max = Duration::from_secs(2);
    }
    c
}

async fn executor(
    url: &str,
    store: Arc<MemoryScaleStore>,
    config: KubeExecutorConfig,
) -> (KubeExecutor, PlannerMetrics) {
    let metrics = PlannerMetrics::default();
    let kube_config = kube::Config::new(url.parse().unwrap());
    let ex = KubeExecutor::new(kube_config, store, config, metrics.clone()).unwrap();
    (ex, metrics)
}

async fn store(prefill: Option<usize>, decode: Option<usize>) -> Arc<MemoryScaleStore> {
    let s = Arc::new(MemoryScaleStore::default());
    if let Some(n) = prefill {
        s.set_target(Role::Prefill, n).await.unwrap();
    }
    if let Some(n) = decode {
        s.set_target(Role::Decode, n).await.unwrap();
    }
    s
}

fn errors(metrics: &PlannerMetrics, pool: &str) -> u64 {
    let text = metrics.render();
    let key = format!("tandem_planner_executor_errors_total{{pool=\"{pool}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .unwrap_or_else(|| panic!("no {key} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn patches_each_pools_scale_subresource_with_a_merge_patch_of_its_target() {
    let api = FakeApi::with(&[("tandem-prefill", 1), ("tandem-decode", 1)]);
    let url = api.serve().await;
    let (mut ex, metrics) = executor(&url, store(Some(3), Some(2)).await, config(false)).await;

    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0], (Role::Prefill, PoolOutcome::Scaled { from: 1, to: 3 })), "{out:?}");
    assert!(matches!(out[1], (Role::Decode, PoolOutcome::Scaled { from: 1, to: 2 })), "{out:?}");
    assert_eq!((api.replicas("tandem-prefill"), api.replicas("tandem-decode")), (3, 2));

    let seen = api.seen();
    let calls: Vec<(String, &str)> =
        seen.iter().map(|s| (s.method.to_string(), s.path.as_str())).collect();
    assert_eq!(
        calls,
        [
            ("GET".to_string(), SCALE_PREFILL),
            ("PATCH".to_string(), SCALE_PREFILL),
            ("GET".to_string(), SCALE_DECODE),
            ("PATCH".to_string(), SCALE_DECODE),
        ]
    );
    for (patch, n) in [(&seen[1], 3), (&seen[3], 2)] {
        assert_eq!(patch.content_type, "application/merge-patch+json");
        assert_eq!(patch.body, Some(json!({ "spec": { "replicas": n } })));
        assert!(patch.query.contains("fieldManager=tandem-planner"), "{}", patch.query);
    }
    assert_eq!(errors(&metrics, "prefill") + errors(&metrics, "decode"), 0);

    // In sync now: the next round only looks.
    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0].1, PoolOutcome::InSync { replicas: 3 }), "{out:?}");
    assert!(matches!(out[1].1, PoolOutcome::InSync { replicas: 2 }), "{out:?}");
    assert_eq!(api.seen().len(), 6);
    assert!(api.seen()[4..].iter().all(|s| s.method == Method::GET));
}

#[tokio::test]
async fn a_target_equal_to_the_current_replicas_sends_no_patch() {
    let api = FakeApi::with(&[("tandem-prefill", 2), ("tandem-decode", 4)]);
    let url = api.serve().await;
    let (mut ex, _) = executor(&url, store(Some(2), Some(4)).await, config(false)).await;
    for _ in 0..3 {
        let out = ex.reconcile().await.unwrap();
        assert!(out.iter().all(|(_, o)| matches!(o, PoolOutcome::InSync { .. })), "{out:?}");
    }
    assert_eq!(api.seen().len(), 6, "{:?}", api.seen());
    assert!(api.seen().iter().all(|s| s.method == Method::GET));
}

#[tokio::test]
async fn a_pool_without_a_target_is_left_alone_and_zero_only_when_asked() {
    // No decode target in etcd: the decode Deployment is neither read nor scaled (to zero or
    // anything else). The prefill target is 0: that one is applied.
    let api = FakeApi::with(&[("tandem-prefill", 2), ("tandem-decode", 3)]);
    let url = api.serve().await;
    let (mut ex, _) = executor(&url, store(Some(0), None).await, config(false)).await;
    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0].1, PoolOutcome::Scaled { from: 2, to: 0 }), "{out:?}");
    assert!(matches!(out[1].1, PoolOutcome::NoTarget), "{out:?}");
    assert_eq!((api.replicas("tandem-prefill"), api.replicas("tandem-decode")), (0, 3));
    assert!(api.seen().iter().all(|s| s.path == SCALE_PREFILL), "{:?}", api.seen());
    // The API server's answer for zero omits spec.replicas; that still reads as in sync.
    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0].1, PoolOutcome::InSync { replicas: 0 }), "{out:?}");
    assert_eq!(api.patches(SCALE_PREFILL).len(), 1);
}

#[tokio::test]
async fn server_errors_are_retried_with_back_off_until_the_patch_lands() {
    let api = FakeApi::with(&[("tandem-prefill", 1), ("tandem-decode", 1)]);
    api.fail(Method::PATCH, "tandem-prefill", &[500, 500]);
    let url = api.serve().await;
    let cfg = config(true);
    let (min, interval) = (cfg.retry_min, cfg.interval);
    let (ex, metrics) = executor(&url, store(Some(3), Some(1)).await, cfg).await;
    let cancel = CancellationToken::new();
    let task = tokio::spawn(ex.run(cancel.clone()));
    let start = Instant::now();
    while api.replicas("tandem-prefill") != 3 {
        assert!(start.elapsed() < Duration::from_secs(10), "never scaled: {:?}", api.seen());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A few more rounds: in sync, nothing more is patched.
    tokio::time::sleep(interval * 10).await;
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the executor stops when cancelled")
        .unwrap();

    let patches = api.patches(SCALE_PREFILL);
    assert_eq!(patches.len(), 3, "two failures and the one that landed: {patches:?}");
    let gaps: Vec<Duration> = patches.windows(2).map(|w| w[1].at - w[0].at).collect();
    assert!(gaps[0] >= min, "first retry after {:?}, back-off is {min:?}", gaps[0]);
    assert!(
        gaps[1] >= 2 * min,
        "second retry after {:?}, back-off doubles to {:?}",
        gaps[1],
        2 * min
    );
    assert!(patches.iter().all(|p| p.body == Some(json!({ "spec": { "replicas": 3 } }))));
    assert_eq!(errors(&metrics, "prefill"), 2);
    assert_eq!(errors(&metrics, "decode"), 0);
    assert!(api.patches(SCALE_DECODE).is_empty(), "decode was in sync");
}

/// The executor's log lines, from a global subscriber (a per-test `set_default` can miss events
/// whose callsite another test thread registered first). Tests tell their lines apart by their
/// namespace, which every executor log line carries.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn global() -> &'static Logs {
        static LOGS: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = Logs::default();
            let writer = logs.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .finish();
            tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
            logs
        })
    }

    /// The lines that mention `needle`.
    fn lines_with(&self, needle: &str) -> String {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines().filter(|l| l.contains(needle)).collect::<Vec<_>>().join("\n")
    }
}

#[tokio::test]
async fn forbidden_is_reported_counted_logged_and_retried_after_the_back_off() {
    let logs = Logs::global();
    const FORBIDDEN_NS: &str = "tandem-forbidden";
    let scale_path = SCALE_PREFILL.replace(NS, FORBIDDEN_NS);
    let api = FakeApi::with(&[("tandem-prefill", 1), ("tandem-decode", 1)]);
    api.fail(Method::PATCH, "tandem-prefill", &[403, 403]);
    let url = api.serve().await;
    // A back-off long enough that one `min` of sleep never reaches the doubled delay.
    let mut cfg = config(true);
    cfg.namespace = FORBIDDEN_NS.into();
    cfg.retry_min = Duration::from_millis(400);
    let min = cfg.retry_min;
    let (mut ex, metrics) = executor(&url, store(Some(2), Some(1)).await, cfg).await;

    let out = ex.reconcile().await.unwrap();
    match &out[0].1 {
        PoolOutcome::Failed {
            error: PlannerError::Executor { executor, pool, size, reason },
            failures: 1,
        } => {
            assert_eq!((*executor, *pool, *size), ("kubernetes", Role::Prefill, 2));
            assert!(reason.contains("HTTP 403 Forbidden"), "{reason}");
            assert!(reason.contains(&format!("PATCH {scale_path}")), "{reason}");
        }
        other => panic!("expected a 403 failure, got {other:?}"),
    }
    assert!(matches!(out[1].1, PoolOutcome::InSync { replicas: 1 }), "{out:?}");
    assert_eq!(errors(&metrics, "prefill"), 1);
    let log = logs.lines_with(FORBIDDEN_NS);
    assert!(
        log.contains("scaling failed; will retry") && log.contains("HTTP 403 Forbidden"),
        "{log}"
    );

    // Inside the back-off nothing is sent for the pool.
    let before = api.seen().len();
    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0].1, PoolOutcome::BackingOff { failures: 1 }), "{out:?}");
    assert!(api.seen()[before..].iter().all(|s| s.path != scale_path));

    // After it, the same target is tried again (still forbidden: counted again, back-off doubles).
    tokio::time::sleep(min).await;
    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0].1, PoolOutcome::Failed { failures: 2, .. }), "{out:?}");
    assert_eq!(errors(&metrics, "prefill"), 2);
    tokio::time::sleep(min).await;
    let out = ex.reconcile().await.unwrap();
    assert!(
        matches!(out[0].1, PoolOutcome::BackingOff { failures: 2 }),
        "still backing off after 1x: {out:?}"
    );

    // RBAC fixed: the next try lands.
    tokio::time::sleep(min).await;
    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0].1, PoolOutcome::Scaled { from: 1, to: 2 }), "{out:?}");
    assert_eq!(api.replicas("tandem-prefill"), 2);
    assert_eq!(api.patches(&scale_path).len(), 3);
    let log = logs.lines_with(FORBIDDEN_NS);
    assert!(log.contains("applied on retry") && log.contains("scaled"), "{log}");
}

#[tokio::test]
async fn a_new_target_is_tried_at_once_despite_an_earlier_back_off() {
    let api = FakeApi::with(&[("tandem-prefill", 1), ("tandem-decode", 1)]);
    api.fail(Method::PATCH, "tandem-prefill", &[500]);
    let url = api.serve().await;
    let store = store(Some(3), Some(1)).await;
    let mut cfg = config(true);
    cfg.retry_min = Duration::from_secs(30);
    cfg.retry_max = Duration::from_secs(30);
    let (mut ex, _) = executor(&url, store.clone(), cfg).await;
    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0].1, PoolOutcome::Failed { failures: 1, .. }), "{out:?}");
    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0].1, PoolOutcome::BackingOff { .. }), "{out:?}");
    store.set_target(Role::Prefill, 4).await.unwrap();
    let out = ex.reconcile().await.unwrap();
    assert!(matches!(out[0].1, PoolOutcome::Scaled { from: 1, to: 4 }), "{out:?}");
}

#[tokio::test]
async fn a_missing_deployment_is_an_error_naming_the_path_not_a_scale_to_zero() {
    let api = FakeApi::with(&[("tandem-decode", 1)]);
    let url = api.serve().await;
    let (mut ex, metrics) = executor(&url, store(Some(2), Some(1)).await, config(false)).await;
    let out = ex.reconcile().await.unwrap();
    match &out[0].1 {
        PoolOutcome::Failed { error: PlannerError::Executor { reason, .. }, .. } => {
            assert!(
                reason.contains("HTTP 404 NotFound")
                    && reason.contains(&format!("GET {SCALE_PREFILL}")),
                "{reason}"
            );
        }
        other => panic!("expected a 404 failure, got {other:?}"),
    }
    assert!(api.patches(SCALE_PREFILL).is_empty());
    assert_eq!(errors(&metrics, "prefill"), 1);
}

#[tokio::test]
async fn an_api_server_that_does_not_answer_is_a_bounded_failure() {
    // A listener that accepts nothing back: the request times out instead of hanging the loop.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let mut cfg = config(true);
    cfg.request_timeout = Duration::from_millis(300);
    let (mut ex, metrics) = executor(&url, store(Some(2), None).await, cfg).await;
    let start = Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(5), ex.reconcile())
        .await
        .expect("bounded")
        .unwrap();
    assert!(matches!(out[0].1, PoolOutcome::Failed { .. }), "{out:?}");
    assert!(start.elapsed() < Duration::from_secs(3));
    assert_eq!(errors(&metrics, "prefill"), 1);
    drop(silent);
}
