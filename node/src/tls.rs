//! TLS on a node's gRPC service (`--tls-cert`, `--tls-key`, optional `--tls-client-ca` for
//! mutual TLS): read and checked before anything else starts, so a bad file stops the node at
//! once with the file's name, never after the model has loaded, and never into plain text.

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::config::ListenArgs;
use crate::error::NodeError;

fn refused(flag: &'static str, e: tandem_cluster::ClusterError) -> NodeError {
    match e {
        tandem_cluster::ClusterError::TlsFile { path, reason } => NodeError::InvalidConfig {
            flag,
            value: path.display().to_string(),
            reason,
        },
        other => NodeError::InvalidConfig {
            flag,
            value: String::new(),
            reason: other.to_string(),
        },
    }
}

/// The gRPC server's TLS configuration from the listen flags (`None`: plain text).
pub fn server_tls(listen: &ListenArgs) -> Result<Option<ServerTlsConfig>, NodeError> {
    let (Some(cert), Some(key)) = (&listen.tls_cert, &listen.tls_key) else {
        // clap's `requires` keeps the three flags together; a config file cannot split them
        // either, since it only fills flags.
        return Ok(None);
    };
    let id = tandem_cluster::tls::read_identity(cert, key).map_err(|e| refused("--tls-cert", e))?;
    let mut config = ServerTlsConfig::new().identity(Identity::from_pem(id.cert_pem, id.key_pem));
    if let Some(ca) = &listen.tls_client_ca {
        let pem = tandem_cluster::tls::read_ca(ca).map_err(|e| refused("--tls-client-ca", e))?;
        config = config.client_ca_root(Certificate::from_pem(pem));
    }
    Ok(Some(config))
}

/// The scheme the node registers its gRPC address with.
pub fn scheme(listen: &ListenArgs) -> &'static str {
    if listen.tls_cert.is_some() {
        "https"
    } else {
        "http"
    }
}
