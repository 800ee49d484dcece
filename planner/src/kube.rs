//! The Kubernetes executor: makes the pools' Deployments follow the desired sizes in etcd.
//!
//! ```text
//!  planner / tandem scale ──set_target──▶ etcd /tandem/{c}/scale/{role}
//!                                              │ targets(), every `interval`
//!                                              ▼
//!                                        KubeExecutor ── GET   …/deployments/{name}/scale
//!                                                     └─ PATCH …/deployments/{name}/scale
//!                                                        (merge patch {"spec":{"replicas":N}},
//!                                                         only when spec.replicas ≠ N)
//! ```
//!
//! Paths are `/apis/apps/v1/namespaces/{namespace}/deployments/{tandem-prefill|tandem-decode}/scale`
//! (an `autoscaling/v1` `Scale`); the RBAC the executor needs is `get` and `patch` on
//! `deployments/scale` for those two names, nothing else (deploy/k8s/base/planner.yaml).
//! Kubernetes then starts pods (which warm up and register) or deletes them (their preStop hook
//! runs `tandem drain`, so a removed node finishes its sequences first).
//!
//! Invariants:
//! - the Deployments follow etcd only: a pool without a target is left as it is (never scaled to
//!   zero because nobody asked), and a pool is set to zero only when its target is zero; when
//!   etcd cannot be read nothing is patched;
//! - a PATCH is sent only when the Deployment's `/scale` says something else than the target, so
//!   every round is idempotent and two executors following one etcd agree;
//! - every failed request (an API status such as 403 or 500, a timeout, a refused connection) is
//!   logged, counted in `tandem_planner_executor_errors_total{pool}` and retried with back-off
//!   (`retry_min`, doubling, at most `retry_max`); a new target for the pool is tried at once;
//! - each request is bounded by `request_timeout`, and kube's own retries are turned off so that
//!   every retry is this module's, logged and counted.
//!
//! Cost: two GETs per `interval` (1 s by default) and a PATCH per change.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ::kube::api::{Api, Patch, PatchParams};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v1::Scale;
use tandem_cluster::{ClusterError, Role, ScaleStore, ScaleTargets};
use tokio_util::sync::CancellationToken;

use crate::actuate::{RETRY_MAX, RETRY_MIN, Retry};
use crate::error::PlannerError;
use crate::metrics::PlannerMetrics;

/// The executor's name in errors and logs.
pub const EXECUTOR: &str = "kubernetes";
/// The field manager named in every PATCH (shown in the Deployment's managedFields).
pub const FIELD_MANAGER: &str = "tandem-planner";

/// Where the pools' Deployments are and how often to look.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeExecutorConfig {
    /// The Deployments' namespace.
    pub namespace: String,
    /// The prefill pool's Deployment.
    pub prefill_deployment: String,
    /// The decode pool's Deployment.
    pub decode_deployment: String,
    /// How often etcd's targets are compared with the Deployments.
    pub interval: Duration,
    /// The longest one API request may take.
    pub request_timeout: Duration,
    /// First delay after a failure; doubles per failure.
    pub retry_min: Duration,
    /// Longest delay between tries.
    pub retry_max: Duration,
}

impl KubeExecutorConfig {
    /// Defaults for `namespace`: `tandem-prefill` / `tandem-decode`, every second, 10 s per
    /// request, the planner's back-off ([`RETRY_MIN`]..[`RETRY_MAX`]).
    pub fn new(namespace: impl Into<String>) -> Self {
        KubeExecutorConfig {
            namespace: namespace.into(),
            prefill_deployment: "tandem-prefill".into(),
            decode_deployment: "tandem-decode".into(),
            interval: Duration::from_secs(1),
            request_timeout: Duration::from_secs(10),
            retry_min: RETRY_MIN,
            retry_max: RETRY_MAX,
        }
    }

    /// `role`'s Deployment.
    pub fn deployment(&self, role: Role) -> &str {
        match role {
            Role::Prefill => &self.prefill_deployment,
            Role::Decode => &self.decode_deployment,
        }
    }

    /// Refuses names Kubernetes would refuse and zero durations, naming the field.
    pub fn validate(&self) -> Result<(), PlannerError> {
        for (field, name) in [
            ("namespace", &self.namespace),
            ("prefill-deployment", &self.prefill_deployment),
            ("decode-deployment", &self.decode_deployment),
        ] {
            if !is_dns1123_label(name) {
                return Err(PlannerError::Config {
                    field,
                    value: name.clone(),
                    reason: "not a Kubernetes name (lower-case letters, digits and '-', \
                             starting and ending with a letter or digit, at most 63)"
                        .into(),
                });
            }
        }
        if self.prefill_deployment == self.decode_deployment {
            return Err(PlannerError::Config {
                field: "decode-deployment",
                value: self.decode_deployment.clone(),
                reason: "the two pools need two Deployments".into(),
            });
        }
        for (field, d) in [
            ("interval", self.interval),
            ("request-timeout", self.request_timeout),
            ("retry-min", self.retry_min),
        ] {
            if d.is_zero() {
                return Err(PlannerError::Config {
                    field,
                    value: "0".into(),
                    reason: "must be positive".into(),
                });
            }
        }
        if self.retry_max < self.retry_min {
            return Err(PlannerError::Config {
                field: "retry-max",
                value: format!("{:?}", self.retry_max),
                reason: format!("below retry-min {:?}", self.retry_min),
            });
        }
        Ok(())
    }
}

fn is_dns1123_label(s: &str) -> bool {
    let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| ok(c) || c == '-')
        && s.starts_with(ok)
        && s.ends_with(ok)
}

/// What one round did for one pool.
#[derive(Debug)]
pub enum PoolOutcome {
    /// etcd holds no target for the pool: its Deployment is left alone.
    NoTarget,
    /// The Deployment already asks for the target.
    InSync {
        /// Its replicas.
        replicas: usize,
    },
    /// The Deployment was patched.
    Scaled {
        /// Replicas before.
        from: usize,
        /// Replicas now (the target).
        to: usize,
    },
    /// An earlier failure's back-off has not run out; nothing was sent.
    BackingOff {
        /// Failures so far for this target.
        failures: u32,
    },
    /// A request failed (logged and counted; retried after the back-off).
    Failed {
        /// What failed.
        error: PlannerError,
        /// Failures so far for this target, this one included.
        failures: u32,
    },
}

/// Makes the Deployments follow etcd's targets (see the module docs).
pub struct KubeExecutor {
    client: ::kube::Client,
    store: Arc<dyn ScaleStore>,
    config: KubeExecutorConfig,
    metrics: PlannerMetrics,
    /// At most one per pool: the failing target and when to try it again.
    backoff: Vec<Retry>,
    /// Whether the last read of etcd failed (logs on change only).
    store_failing: bool,
}

impl std::fmt::Debug for KubeExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeExecutor").field("config", &self.config).finish_non_exhaustive()
    }
}

/// The in-cluster configuration (service account token, CA, `KUBERNETES_SERVICE_HOST`), or
/// the kubeconfig when run outside a cluster. Its `default_namespace` is the pod's namespace.
pub async fn infer_kube_config() -> Result<::kube::Config, PlannerError> {
    ::kube::Config::infer().await.map_err(|e| PlannerError::Config {
        field: "executor",
        value: EXECUTOR.into(),
        reason: format!("no Kubernetes configuration (in-cluster or kubeconfig): {e}"),
    })
}

impl KubeExecutor {
    /// An executor talking to the API server `kube_config` describes (in-cluster: see
    /// [`infer_kube_config`]; tests: `kube::Config::new(url)`).
    pub fn new(
        mut kube_config: ::kube::Config,
        store: Arc<dyn ScaleStore>,
        config: KubeExecutorConfig,
        metrics: PlannerMetrics,
    ) -> Result<Self, PlannerError> {
        config.validate()?;
        // Every retry is ours (logged, counted, backed off); each request is bounded.
        kube_config.default_retry = false;
        kube_config.read_timeout = Some(config.request_timeout);
        kube_config.write_timeout = Some(config.request_timeout);
        kube_config.connect_timeout = Some(config.request_timeout);
        let client = ::kube::Client::try_from(kube_config).map_err(|e| PlannerError::Config {
            field: "executor",
            value: EXECUTOR.into(),
            reason: format!("building the Kubernetes client: {e}"),
        })?;
        Ok(KubeExecutor {
            client,
            store,
            config,
            metrics,
            backoff: Vec::new(),
            store_failing: false,
        })
    }

    /// Its settings.
    pub fn config(&self) -> &KubeExecutorConfig {
        &self.config
    }

    /// Reconciles every `interval` until `cancel` fires. Failures never end it.
    pub async fn run(mut self, cancel: CancellationToken) {
        tracing::info!(
            namespace = %self.config.namespace,
            prefill = %self.config.prefill_deployment,
            decode = %self.config.decode_deployment,
            "kubernetes executor: following the pools' targets in etcd"
        );
        let mut tick = tokio::time::interval(self.config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.reconcile() => {}
            }
        }
    }

    /// One round: reads the targets and brings each Deployment to its pool's. Errors reading
    /// etcd are returned (nothing is patched); API failures are in the outcomes.
    pub async fn reconcile(&mut self) -> Result<Vec<(Role, PoolOutcome)>, PlannerError> {
        let targets =
            match tokio::time::timeout(self.config.request_timeout, self.store.targets()).await {
                Ok(Ok(t)) => t,
                Ok(Err(e)) => return Err(self.store_failed(e.into())),
                Err(_) => {
                    let after = self.config.request_timeout;
                    return Err(self.store_failed(
                        ClusterError::EtcdTimeout { op: "read scale targets", after }.into(),
                    ));
                }
            };
        if std::mem::take(&mut self.store_failing) {
            tracing::info!("kubernetes executor: reading the targets works again");
        }
        let mut out = Vec::with_capacity(2);
        for role in [Role::Prefill, Role::Decode] {
            out.push((role, self.reconcile_pool(role, &targets).await));
        }
        Ok(out)
    }

    fn store_failed(&mut self, e: PlannerError) -> PlannerError {
        if !std::mem::replace(&mut self.store_failing, true) {
            tracing::warn!(error = %e, "kubernetes executor: cannot read the targets; patching nothing until it can");
        }
        e
    }

    async fn reconcile_pool(&mut self, role: Role, targets: &ScaleTargets) -> PoolOutcome {
        let Some(target) = targets.of(role) else {
            self.backoff.retain(|r| r.pool != role);
            return PoolOutcome::NoTarget;
        };
        // A new target is tried at once; the same one waits out its back-off.
        self.backoff.retain(|r| r.pool != role || r.size == target);
        let now = Instant::now();
        let failures = match self.backoff.iter().find(|r| r.pool == role) {
            Some(r) if r.next_at > now => {
                return PoolOutcome::BackingOff { failures: r.failures };
            }
            Some(r) => r.failures,
            None => 0,
        };
        match self.scale_to(role, target).await {
            Ok(from) => {
                self.backoff.retain(|r| r.pool != role);
                if failures > 0 {
                    tracing::info!(
                        namespace = %self.config.namespace,
                        pool = %role,
                        size = target,
                        after_failures = failures,
                        "kubernetes executor: applied on retry"
                    );
                }
                match from {
                    None => PoolOutcome::InSync { replicas: target },
                    Some(from) => {
                        tracing::info!(
                            namespace = %self.config.namespace,
                            pool = %role,
                            deployment = %self.config.deployment(role),
                            from,
                            to = target,
                            "kubernetes executor: scaled"
                        );
                        PoolOutcome::Scaled { from, to: target }
                    }
                }
            }
            Err(error) => {
                let delay = self
                    .config
                    .retry_min
                    .saturating_mul(1 << failures.min(16))
                    .min(self.config.retry_max);
                let retry = Retry {
                    pool: role,
                    size: target,
                    failures: failures + 1,
                    next_at: Instant::now() + delay,
                };
                self.metrics.executor_failed(role.as_str());
                tracing::warn!(
                    executor = EXECUTOR,
                    namespace = %self.config.namespace,
                    pool = %role,
                    deployment = %self.config.deployment(role),
                    size = target,
                    failures = retry.failures,
                    retry_in_ms = delay.as_millis() as u64,
                    error = %error,
                    "kubernetes executor: scaling failed; will retry"
                );
                let failures = retry.failures;
                self.backoff.retain(|r| r.pool != role);
                self.backoff.push(retry);
                PoolOutcome::Failed { error, failures }
            }
        }
    }

    /// Brings `role`'s Deployment to `target` replicas: `Ok(None)` when it already was,
    /// `Ok(Some(before))` when patched.
    async fn scale_to(&self, role: Role, target: usize) -> Result<Option<usize>, PlannerError> {
        let fail = |reason: String| PlannerError::Executor {
            executor: EXECUTOR,
            pool: role,
            size: target,
            reason,
        };
        let replicas = i32::try_from(target)
            .map_err(|_| fail("more replicas than Kubernetes allows".into()))?;
        let name = self.config.deployment(role);
        let api: Api<Deployment> = Api::namespaced(self.client.clone(), &self.config.namespace);
        let path = self.scale_path(name);
        let timeout = self.config.request_timeout;
        let current = tokio::time::timeout(timeout, api.get_scale(name)).await;
        let current = spec_replicas(&answer("GET", &path, timeout, current).map_err(fail)?);
        if current == replicas {
            return Ok(None);
        }
        let params =
            PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
        let patch = Patch::Merge(serde_json::json!({ "spec": { "replicas": replicas } }));
        let after = tokio::time::timeout(timeout, api.patch_scale(name, &params, &patch)).await;
        let after = spec_replicas(&answer("PATCH", &path, timeout, after).map_err(fail)?);
        if after != replicas {
            return Err(fail(format!(
                "the API server answered spec.replicas = {after} after the PATCH"
            )));
        }
        Ok(Some(current.max(0) as usize))
    }

    fn scale_path(&self, name: &str) -> String {
        format!("/apis/apps/v1/namespaces/{}/deployments/{name}/scale", self.config.namespace)
    }
}

/// A bounded request's answer, or what went wrong with it.
fn answer(
    method: &str,
    path: &str,
    timeout: Duration,
    r: Result<Result<Scale, ::kube::Error>, tokio::time::error::Elapsed>,
) -> Result<Scale, String> {
    match r {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(format!("{method} {path}: {}", describe(&e))),
        Err(_) => Err(format!("{method} {path}: no answer within {timeout:?}")),
    }
}

/// `spec.replicas` of a `/scale` (absent means 0: the field is omitted when zero).
fn spec_replicas(s: &Scale) -> i32 {
    s.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0)
}

/// An API error as an operator reads it: the HTTP status and Kubernetes' reason and message.
fn describe(e: &::kube::Error) -> String {
    match e {
        ::kube::Error::Api(s) => format!("HTTP {} {}: {}", s.code, s.reason, s.message),
        e => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_refuses_names_kubernetes_would_refuse() {
        let ok = KubeExecutorConfig::new("tandem");
        assert!(ok.validate().is_ok());
        for (bad, field) in [
            (KubeExecutorConfig { namespace: "Tandem".into(), ..ok.clone() }, "namespace"),
            (
                KubeExecutorConfig { prefill_deployment: "-x".into(), ..ok.clone() },
                "prefill-deployment",
            ),
            (
                KubeExecutorConfig { decode_deployment: "tandem-prefill".into(), ..ok.clone() },
                "decode-deployment",
            ),
            (
                KubeExecutorConfig { decode_deployment: "a".repeat(64), ..ok.clone() },
                "decode-deployment",
            ),
            (KubeExecutorConfig { interval: Duration::ZERO, ..ok.clone() }, "interval"),
            (KubeExecutorConfig { retry_max: Duration::from_millis(1), ..ok.clone() }, "retry-max"),
        ] {
            match bad.validate() {
                Err(PlannerError::Config { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{bad:?}: expected a config error on {field}, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn an_https_client_builds_with_the_workspaces_one_tls_provider() {
        // In a cluster the API server is https: the client must pick its rustls provider
        // without help (a second provider in the build would make it panic here).
        let url = "https://127.0.0.1:1".parse().unwrap();
        let store = Arc::new(tandem_cluster::MemoryScaleStore::default());
        let ex = KubeExecutor::new(
            ::kube::Config::new(url),
            store,
            KubeExecutorConfig::new("tandem"),
            PlannerMetrics::default(),
        );
        assert!(ex.is_ok(), "{ex:?}");
    }
}
