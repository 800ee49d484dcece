//! TLS files every tandem process reads the same way: a PEM certificate chain and its key (a
//! server's or a client's identity), and a PEM CA bundle (whom to trust).
//!
//! Invariant: a file is refused at startup, with its path and the reason, when it cannot be
//! used: missing, not PEM, no certificate in it, a key that does not parse or does not belong
//! to the certificate. Nothing falls back to plain text or to "trust anything".

use std::path::Path;
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls;

use crate::error::ClusterError;

fn bad(path: &Path, reason: impl std::fmt::Display) -> ClusterError {
    ClusterError::TlsFile {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ClusterError> {
    std::fs::read(path).map_err(|e| bad(path, e))
}

fn certificates(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, ClusterError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| bad(path, format!("not PEM certificates: {e}")))?;
    if chain.is_empty() {
        return Err(bad(path, "holds no certificate"));
    }
    Ok(chain)
}

/// A certificate chain and its private key, read and checked.
#[derive(Clone)]
pub struct PemIdentity {
    /// The chain as read (leaf first).
    pub cert_pem: Vec<u8>,
    /// The key as read.
    pub key_pem: Vec<u8>,
    /// A rustls server configuration over them (no client authentication, no ALPN).
    pub server_config: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for PemIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PemIdentity").finish_non_exhaustive()
    }
}

/// Reads `cert` (a PEM chain) and `key` (its PEM private key) and checks they belong together.
pub fn read_identity(cert: &Path, key: &Path) -> Result<PemIdentity, ClusterError> {
    let (cert_pem, key_pem) = (read(cert)?, read(key)?);
    let chain = certificates(&cert_pem, cert)?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| bad(key, format!("not a PEM private key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server_config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(cert, e))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| bad(key, format!("does not fit the certificate: {e}")))?;
    Ok(PemIdentity {
        cert_pem,
        key_pem,
        server_config: Arc::new(server_config),
    })
}

/// Reads a PEM CA bundle (at least one certificate).
pub fn read_ca(path: &Path) -> Result<Vec<u8>, ClusterError> {
    let pem = read(path)?;
    certificates(&pem, path)?;
    Ok(pem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unusable_files_are_refused_naming_them() {
        let dir = std::env::temp_dir().join(format!("tandem-tls-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not pem").unwrap();
        let missing = dir.join("missing.pem");
        for (result, path) in [
            (read_ca(&missing).map(|_| ()), &missing),
            (read_ca(&junk).map(|_| ()), &junk),
            (read_identity(&junk, &junk).map(|_| ()), &junk),
        ] {
            let err = result.unwrap_err();
            assert!(
                matches!(&err, ClusterError::TlsFile { path: p, .. } if p == path),
                "{err:?}"
            );
            assert!(!err.is_retryable());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
