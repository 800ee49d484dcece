//! TLS on the router's ingresses: one certificate chain and key (PEM files, `--tls-cert` and
//! `--tls-key`) serve both the HTTP (OpenAI) and the gRPC listener.
//!
//! ```text
//!  --tls-cert, --tls-key ─▶ TlsIdentity::load (both read and checked at startup: a bad file is
//!                           an error naming it, never a plain-text fallback)
//!        ├─▶ gRPC: tonic's ServerTlsConfig (ALPN h2)
//!        └─▶ HTTP: rustls ServerConfig (ALPN h2, http/1.1) ─▶ accept loop ─▶ hyper (auto h1/h2)
//! ```
//! Invariants: with an identity configured, neither listener ever answers in plain text (a
//! plain-text client fails its handshake); a failed handshake costs only that connection.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls;

use crate::error::RouterError;

/// A certificate chain and its private key, read from PEM files and checked.
#[derive(Clone)]
pub struct TlsIdentity {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    server_config: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIdentity").finish_non_exhaustive()
    }
}

/// A TLS file the cluster crate refused, as the router reports it.
fn tls_error(e: tandem_cluster::ClusterError) -> RouterError {
    match e {
        tandem_cluster::ClusterError::TlsFile { path, reason } => RouterError::Tls {
            path,
            message: reason,
        },
        other => RouterError::Cluster(other),
    }
}

/// Where the PEM files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain (leaf first).
    pub cert: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

impl TlsIdentity {
    /// Reads and checks both files: the chain must hold a certificate, the key must parse
    /// and match it.
    pub fn load(files: &TlsFiles) -> Result<TlsIdentity, RouterError> {
        let id = tandem_cluster::tls::read_identity(&files.cert, &files.key).map_err(tls_error)?;
        let mut config = (*id.server_config).clone();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(TlsIdentity {
            cert_pem: id.cert_pem,
            key_pem: id.key_pem,
            server_config: Arc::new(config),
        })
    }

    /// The rustls configuration of the HTTP listener.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.server_config)
    }

    /// The tonic configuration of the gRPC listener.
    pub fn grpc_config(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(
            &self.cert_pem,
            &self.key_pem,
        ))
    }
}

/// The client TLS configuration towards `https://` nodes: `ca` verifies them; `identity`
/// (certificate chain, key), for nodes that require client certificates.
pub fn node_client_config(
    ca: Option<&Path>,
    identity: Option<(&Path, &Path)>,
) -> Result<Option<tonic::transport::ClientTlsConfig>, RouterError> {
    let Some(ca) = ca else {
        return Ok(None);
    };
    let pem = tandem_cluster::tls::read_ca(ca).map_err(tls_error)?;
    let mut config = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(pem));
    if let Some((cert, key)) = identity {
        let id = tandem_cluster::tls::read_identity(cert, key).map_err(tls_error)?;
        config = config.identity(tonic::transport::Identity::from_pem(
            id.cert_pem,
            id.key_pem,
        ));
    }
    Ok(Some(config))
}
