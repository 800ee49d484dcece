//! The gRPC server every node runs: the role's service plus `grpc.health.v1.Health`
//! (tonic-health) and server reflection v1 (tonic-reflection), on a listener bound beforehand
//! (port 0 works), until a stop token fires; over TLS (mutual with a client CA) when the node
//! has `--tls-cert` ([`crate::tls`]).
//!
//! Health: the role's service and the overall (`""`) status are SERVING from start until the
//! node begins draining, then NOT_SERVING, so load balancers and `grpc_health_probe` stop
//! sending new work while in-flight streams finish.

use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::error::NodeError;

/// A running gRPC server.
pub struct GrpcServer {
    service_name: &'static str,
    health: HealthReporter,
    stop: CancellationToken,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

/// Serves `routes` (the role's service) plus health and reflection on `listener`.
/// `service_name` is the role service's full name (e.g. `tandem.v1.Prefill`). Must be called
/// inside a tokio runtime.
pub async fn spawn(
    listener: TcpListener,
    routes: Routes,
    service_name: &'static str,
    tls: Option<tonic::transport::ServerTlsConfig>,
) -> Result<GrpcServer, NodeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(service_name, ServingStatus::Serving)
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tandem_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name(service_name)
        .with_service_name("grpc.health.v1.Health")
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .build_v1()
        .map_err(|e| NodeError::InvalidConfig {
            flag: "reflection",
            value: service_name.into(),
            reason: e.to_string(),
        })?;
    let routes = routes.add_service(health_service).add_service(reflection);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls).map_err(|e| NodeError::InvalidConfig {
            flag: "--tls-cert",
            value: String::new(),
            reason: e.to_string(),
        })?;
    }
    let stop = CancellationToken::new();
    let signal = stop.clone();
    let task = tokio::spawn(async move {
        builder
            .add_routes(routes)
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), signal.cancelled_owned())
            .await
    });
    Ok(GrpcServer {
        service_name,
        health,
        stop,
        task,
    })
}

impl GrpcServer {
    /// Marks the node NOT_SERVING (draining): health checkers stop routing new work here.
    pub async fn set_not_serving(&self) {
        self.health
            .set_service_status(self.service_name, ServingStatus::NotServing)
            .await;
        self.health
            .set_service_status("", ServingStatus::NotServing)
            .await;
    }

    /// Stops accepting, lets open calls end for up to `grace`, then drops the rest.
    pub async fn stop(self, grace: Duration) -> Result<(), NodeError> {
        self.stop.cancel();
        let mut task = self.task;
        match tokio::time::timeout(grace, &mut task).await {
            Ok(Ok(r)) => r.map_err(NodeError::Grpc),
            Ok(Err(_join)) => Ok(()),
            Err(_) => {
                tracing::warn!(
                    ?grace,
                    "gRPC connections still open after the grace period; closing them"
                );
                task.abort();
                Ok(())
            }
        }
    }
}
