//! TLS on the ingresses (`--tls-cert`, `--tls-key`), with a CA made in the test (rcgen): HTTPS
//! and gRPC over TLS serve real generations for a client that trusts the CA; a plain-text
//! client and a client trusting another CA get nothing; bad files are refused at startup,
//! naming the file.

use crate::common;

use std::sync::Arc;

use common::fakes::{
    expected_output, start_decode, start_decode_with, start_prefill, start_prefill_with,
};
use common::{
    MemoryCluster, collect, grpc_request, http_request_bytes, model, options, prompt_tokens,
};
use tandem_proto::v1::inference_client::InferenceClient;
use tandem_router::RouterError;
use tandem_router::tls::{TlsFiles, TlsIdentity};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_util::sync::CancellationToken;

/// A CA, and a server certificate it signed for `localhost` and 127.0.0.1 (PEM).
struct Pki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
    /// A client certificate the same CA signed (the router's, for mutual TLS).
    client_cert_pem: String,
    client_key_pem: String,
}

fn make_pki(name: &str) -> Pki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} test CA"));
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
    let client_key = rcgen::KeyPair::generate().unwrap();
    let client = rcgen::CertificateParams::new(vec!["router".to_string()])
        .unwrap()
        .signed_by(&client_key, &issuer)
        .unwrap();
    Pki {
        ca_pem: ca_cert.pem(),
        cert_pem: leaf.pem(),
        key_pem: key.serialize_pem(),
        client_cert_pem: client.pem(),
        client_key_pem: client_key.serialize_pem(),
    }
}

fn write_files(dir: &std::path::Path, pki: &Pki) -> TlsFiles {
    std::fs::create_dir_all(dir).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, &pki.cert_pem).unwrap();
    std::fs::write(&key, &pki.key_pem).unwrap();
    TlsFiles { cert, key }
}

fn connector(ca_pem: &str) -> tokio_rustls::TlsConnector {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One HTTP/1.1 POST over TLS; the raw response, or the handshake's error.
async fn https_post(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    path: &str,
    body: &str,
) -> std::io::Result<String> {
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector(ca_pem).connect(name, tcp).await?;
    tls.write_all(&http_request_bytes("POST", path, Some(body), None))
        .await?;
    let mut raw = Vec::new();
    // A server closing without close_notify after `Connection: close` is fine here.
    let _ = tls.read_to_end(&mut raw).await;
    Ok(String::from_utf8_lossy(&raw).into_owned())
}

#[tokio::test]
async fn both_ingresses_serve_tls_only_to_clients_that_trust_the_ca() {
    let pki = make_pki("tandem");
    let dir = std::env::temp_dir().join(format!("tandem-tls-{}", std::process::id()));
    let identity = TlsIdentity::load(&write_files(&dir, &pki)).expect("the test PKI loads");

    let mut cluster = MemoryCluster::new();
    let (p, d) = (start_prefill("p0").await, start_decode("d0").await);
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let router = cluster.router(options()).await.router.clone();
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (grpc_addr, http_addr) = (grpc.local_addr().unwrap(), http.local_addr().unwrap());
    let stop = CancellationToken::new();
    let server = tokio::spawn(tandem_router::serve_tls(
        router,
        grpc,
        http,
        Some(identity),
        stop.clone().cancelled_owned(),
    ));

    // HTTPS: a real completion.
    let body = r#"{"prompt": "The sky is", "max_tokens": 5}"#;
    let reply = https_post(http_addr, &pki.ca_pem, "/v1/completions", body)
        .await
        .expect("the TLS handshake succeeds with the CA");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let (_, text) = expected_output(prompt_tokens("The sky is"), 5);
    assert!(reply.contains(&text), "{reply}");

    // gRPC over TLS: a real generation.
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{grpc_addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("gRPC connects over TLS");
    let stream = InferenceClient::new(channel)
        .generate(grpc_request("The sky is", 4))
        .await
        .expect("Generate over TLS")
        .into_inner();
    let out = collect(stream).await.unwrap();
    assert_eq!(out.ids, expected_output(prompt_tokens("The sky is"), 4).0);

    // Plain text gets no HTTP answer on either port.
    for addr in [http_addr, grpc_addr] {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let _ = tcp
            .write_all(&http_request_bytes(
                "POST",
                "/v1/completions",
                Some(body),
                None,
            ))
            .await;
        let mut raw = Vec::new();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_to_end(&mut raw))
            .await;
        assert!(
            !String::from_utf8_lossy(&raw).contains("HTTP/1.1 200"),
            "plain text was served on {addr}"
        );
    }

    // A client that trusts another CA refuses the server's certificate.
    let other = make_pki("other");
    let refused = https_post(http_addr, &other.ca_pem, "/v1/completions", body).await;
    assert!(
        refused.is_err(),
        "a certificate from an untrusted CA was accepted"
    );

    stop.cancel();
    server.await.unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    drop((p, d, cluster));
}

#[test]
fn bad_tls_files_are_refused_at_startup_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("tandem-tls-bad-{}", std::process::id()));
    let pki = make_pki("tandem");
    let good = write_files(&dir, &pki);
    let expect_tls_error = |files: &TlsFiles, file: &std::path::Path| {
        let err = TlsIdentity::load(files).unwrap_err();
        assert!(
            matches!(&err, RouterError::Tls { path, .. } if path == file),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(&file.display().to_string()),
            "{err}"
        );
    };
    // Missing file.
    let missing = dir.join("nope.pem");
    expect_tls_error(
        &TlsFiles {
            cert: missing.clone(),
            key: good.key.clone(),
        },
        &missing,
    );
    // Not PEM.
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    expect_tls_error(
        &TlsFiles {
            cert: junk.clone(),
            key: good.key.clone(),
        },
        &junk,
    );
    expect_tls_error(
        &TlsFiles {
            cert: good.cert.clone(),
            key: junk.clone(),
        },
        &junk,
    );
    // A key that is not the certificate's.
    let other = make_pki("other");
    let other_key = dir.join("other-key.pem");
    std::fs::write(&other_key, &other.key_pem).unwrap();
    expect_tls_error(
        &TlsFiles {
            cert: good.cert.clone(),
            key: other_key.clone(),
        },
        &other_key,
    );
    assert!(TlsIdentity::load(&good).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Nodes that serve gRPC over TLS and require client certificates (`--tls-cert`,
/// `--tls-client-ca`): a router with the CA and its own certificate (`--node-tls-ca`,
/// `--node-tls-cert`, `--node-tls-key`) serves through them; one without its certificate is
/// refused by the nodes (a clear error, no hang); one without the CA refuses `https://` nodes,
/// naming the flag.
#[tokio::test]
async fn the_router_reaches_nodes_over_mutual_tls_and_nothing_less() {
    use futures_util::StreamExt;
    use tandem_router::{
        GenerateRequest, GenerationEvent, PromptInput, Router, Sampling, TcpConnector,
    };

    let pki = make_pki("nodes");
    let dir = std::env::temp_dir().join(format!("tandem-mtls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, pem: &str| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    let (ca, client_cert, client_key) = (
        write("ca.pem", &pki.ca_pem),
        write("router.pem", &pki.client_cert_pem),
        write("router-key.pem", &pki.client_key_pem),
    );
    let server_tls = || {
        tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(
                &pki.cert_pem,
                &pki.key_pem,
            ))
            .client_ca_root(tonic::transport::Certificate::from_pem(&pki.ca_pem))
    };
    let mut cluster = MemoryCluster::new();
    let p = start_prefill_with("p0", Some(server_tls())).await;
    let d = start_decode_with("d0", Some(server_tls())).await;
    assert!(p.info().grpc_addr.starts_with("https://"));
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;

    // Clones share the cluster's registry and load bus (nodes registered later are seen).
    let (discovery, loads) = (cluster.discovery.clone(), cluster.loads.clone());
    let router_with = |tls: Option<tonic::transport::ClientTlsConfig>| {
        let (discovery, loads) = (discovery.clone(), loads.clone());
        async move {
            Router::start_with_connector(
                model(),
                options(),
                Arc::new(discovery),
                Arc::new(loads),
                tandem_router::Stores::memory(),
                Arc::new(TcpConnector { tls }),
            )
            .await
            .unwrap()
        }
    };
    let generate = |router: Router| async move {
        let request = GenerateRequest {
            model: String::new(),
            input: PromptInput::Text("The sky is".into()),
            sampling: Sampling {
                max_tokens: Some(4),
                ..Default::default()
            },
            priority: Default::default(),
            request_id: None,
        };
        let mut stream = router.generate(request).await?;
        let mut ids = Vec::new();
        while let Some(event) = stream.next().await {
            if let GenerationEvent::Delta { token_ids, .. } = event? {
                ids.extend(token_ids);
            }
        }
        Ok::<_, RouterError>(ids)
    };

    // Mutual TLS: served.
    let full = tandem_router::tls::node_client_config(Some(&ca), Some((&client_cert, &client_key)))
        .unwrap();
    let ids = generate(router_with(full).await)
        .await
        .expect("served over mutual TLS");
    assert_eq!(ids, expected_output(prompt_tokens("The sky is"), 4).0);

    // The CA but no client certificate: the nodes refuse the handshake.
    let ca_only = tandem_router::tls::node_client_config(Some(&ca), None).unwrap();
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        generate(router_with(ca_only).await),
    )
    .await
    .expect("a refused handshake ends the request, it does not hang")
    .unwrap_err();
    assert!(!err.is_client_error(), "{err}");

    // No CA at all: `https://` nodes are refused, naming the flag.
    let err = generate(router_with(None).await).await.unwrap_err();
    assert!(format!("{err:?}").contains("--node-tls-ca"), "{err:?}");

    // Plain-text nodes beside them: a router without the CA serves through those, passing over
    // the https:// ones it cannot reach.
    let (p1, d1) = (start_prefill("p1").await, start_decode("d1").await);
    cluster.register(p1.info()).await;
    cluster.register(d1.info()).await;
    let ids = generate(router_with(None).await)
        .await
        .expect("served by the plain nodes");
    assert_eq!(ids, expected_output(prompt_tokens("The sky is"), 4).0);

    let _ = std::fs::remove_dir_all(&dir);
    drop((p, d, p1, d1));
}
