//! Running a router: both ingresses on bound listeners with one shutdown
//! ([`serve`]), and the whole process from a [`RouterConfig`] ([`run`], [`run_blocking`]).
//!
//! Shutdown: the shutdown future stops both servers from accepting; the HTTP server lets
//! running responses finish, the gRPC server drains its connections. Requests' node streams
//! end with them.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tandem_cluster::{
    Discovery, EtcdConfig, EtcdDiscovery, LoadSignals, NatsConfig, NatsLoadSignals,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{RouterArgs, RouterConfig};
use crate::error::RouterError;
use crate::model::ServedModel;
use crate::pipeline::Router;
use crate::tls::TlsIdentity;

/// Serves the gRPC ingress on `grpc` and the HTTP ingress on `http` until `shutdown`
/// resolves or either server fails.
pub async fn serve(
    router: Router,
    grpc: TcpListener,
    http: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    serve_tls(router, grpc, http, None, shutdown).await
}

/// [`serve`], with both ingresses behind TLS when `tls` is given (never plain text then).
pub async fn serve_tls(
    router: Router,
    grpc: TcpListener,
    http: TcpListener,
    tls: Option<TlsIdentity>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let token = CancellationToken::new();
    let grpc_server = crate::grpc::serve(
        grpc,
        router.clone(),
        tls.as_ref(),
        token.clone().cancelled_owned(),
    );
    let http_server = crate::http::serve(http, router, tls.clone(), token.clone().cancelled_owned());
    let trigger = {
        let token = token.clone();
        async move {
            shutdown.await;
            token.cancel();
        }
    };
    let (grpc_result, http_result, ()) = tokio::join!(
        async {
            let r = grpc_server.await;
            token.cancel();
            r
        },
        async {
            let r = http_server.await;
            token.cancel();
            r
        },
        async {
            tokio::select! {
                () = trigger => {}
                () = token.cancelled() => {}
            }
        }
    );
    grpc_result.and(http_result)
}

/// Connects to the control plane, loads the model's tokenizer, binds both addresses and
/// serves until `shutdown` resolves.
pub async fn run(
    config: RouterConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let mut model = ServedModel::from_gguf(&config.model_path, config.model_name.as_deref())?;
    if let Some(cap) = config.max_context_tokens {
        model.context_tokens = model.context_tokens.min(cap);
    }
    let router = start_with_retries(&config, model).await?;
    if router.api_keys().file().is_some() {
        tokio::spawn(crate::keys::watch_file(router.downgrade()));
    }
    let bind = |server: &'static str, addr| async move {
        TcpListener::bind(addr)
            .await
            .map_err(|e| RouterError::Serve {
                server,
                message: format!("cannot bind {addr}: {e}"),
            })
    };
    let grpc = bind("grpc", config.grpc_addr).await?;
    let http = bind("http", config.http_addr).await?;
    let local = |l: &TcpListener| l.local_addr().map(|a| a.to_string()).unwrap_or_default();
    tracing::info!(
        cluster = %config.cluster,
        model = %router.model().name,
        context_tokens = router.model().context_tokens,
        grpc = %local(&grpc),
        http = %local(&http),
        tls = config.tls.is_some(),
        "router serving"
    );
    // Machine-readable lines for scripts (`tandem up` waits for them).
    println!("grpc {}", local(&grpc));
    println!("http {}", local(&http));
    let result = serve_tls(router.clone(), grpc, http, config.tls.clone(), shutdown).await;
    // What this router counted and had not written yet goes to the ledger before it exits.
    if let Err(e) = router.flush_usage().await {
        tracing::warn!(error = %e, "could not write the last usage to the ledger");
    }
    result
}

/// Connects to etcd and NATS and starts the router, retrying retryable control-plane errors
/// (backoff 100 ms doubling to 2 s) until `config.startup_timeout` has passed.
async fn start_with_retries(
    config: &RouterConfig,
    model: ServedModel,
) -> Result<Router, RouterError> {
    let deadline = tokio::time::Instant::now() + config.startup_timeout;
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            let signals: Arc<dyn LoadSignals> = Arc::new(
                NatsLoadSignals::connect(NatsConfig::new(
                    config.nats_url.clone(),
                    config.cluster.clone(),
                ))
                .await?,
            );
            let etcd = EtcdDiscovery::connect(EtcdConfig::new(
                config.etcd_endpoints.clone(),
                config.cluster.clone(),
            ))
            .await?;
            let stores = crate::pipeline::Stores {
                usage: Arc::new(etcd.usage_store()),
                limits: Arc::new(
                    etcd.rate_limit_store()
                        .with_timeout(crate::ratelimit::STORE_TIMEOUT),
                ),
            };
            let discovery: Arc<dyn Discovery> = Arc::new(etcd);
            let connector = Arc::new(crate::nodes::TcpConnector {
                tls: config.node_tls.clone(),
            });
            Router::start_with_connector(
                model.clone(),
                config.options.clone(),
                discovery,
                signals,
                stores,
                connector,
            )
            .await
        };
        match attempt.await {
            Ok(router) => return Ok(router),
            Err(RouterError::Cluster(error))
                if error.is_retryable() && tokio::time::Instant::now() + delay < deadline =>
            {
                tracing::warn!(%error, retry_in = ?delay, "control plane unreachable at startup; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(error) => return Err(error),
        }
    }
}

/// Resolves `args`, builds a multi-threaded runtime and runs the router until Ctrl-C or
/// SIGTERM. For the `tandem-router` binary and `tandem router`.
pub fn run_blocking(args: RouterArgs) -> Result<(), RouterError> {
    let config = args.resolve()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| RouterError::Serve {
            server: "runtime",
            message: e.to_string(),
        })?;
    runtime.block_on(run(config, shutdown_signal()))
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        // If the handler cannot be installed, only SIGTERM (or a kill) stops the process.
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutting down");
}
