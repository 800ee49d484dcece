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

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
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

/// Where the PEM files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain (leaf first).
    pub cert: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

fn bad(path: &Path, what: impl std::fmt::Display) -> RouterError {
    RouterError::Tls {
        path: path.to_path_buf(),
        message: what.to_string(),
    }
}

impl TlsIdentity {
    /// Reads and checks both files: the chain must hold a certificate, the key must parse
    /// and match it.
    pub fn load(files: &TlsFiles) -> Result<TlsIdentity, RouterError> {
        let read = |p: &Path| std::fs::read(p).map_err(|e| bad(p, e));
        let (cert_pem, key_pem) = (read(&files.cert)?, read(&files.key)?);
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| bad(&files.cert, format!("not a PEM certificate chain: {e}")))?;
        if chain.is_empty() {
            return Err(bad(&files.cert, "holds no certificate"));
        }
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| bad(&files.key, format!("not a PEM private key: {e}")))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(&files.cert, e))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| bad(&files.key, format!("does not fit the certificate: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(TlsIdentity {
            cert_pem,
            key_pem,
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
