//! A node's gRPC service over TLS (`--tls-cert`, `--tls-key`) and mutual TLS
//! (`--tls-client-ca`), with a CA made in the test: a client with the CA and a certificate it
//! signed is served; a client without a certificate, or with one from another CA, is refused;
//! plain text is not served; unusable files stop the node before it starts, naming the flag
//! and the file.

use clap::Parser;
use tandem_node::config::ListenArgs;
use tandem_node::{NodeError, server, tls};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    listen: ListenArgs,
}

struct Pki {
    ca: String,
    cert: String,
    key: String,
    client_cert: String,
    client_key: String,
}

fn pki(name: &str) -> Pki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} CA"));
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let leaf = |names: Vec<String>| {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (cert, key) = leaf(vec!["localhost".into()]);
    let (client_cert, client_key) = leaf(vec!["router".into()]);
    Pki {
        ca: ca_cert.pem(),
        cert,
        key,
        client_cert,
        client_key,
    }
}

fn listen_args(dir: &std::path::Path, pki: &Pki, client_ca: bool) -> ListenArgs {
    std::fs::create_dir_all(dir).unwrap();
    let file = |name: &str, pem: &str| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p.display().to_string()
    };
    let mut argv = vec![
        "node".to_string(),
        "--tls-cert".into(),
        file("cert.pem", &pki.cert),
        "--tls-key".into(),
        file("key.pem", &pki.key),
    ];
    if client_ca {
        argv.extend(["--tls-client-ca".into(), file("ca.pem", &pki.ca)]);
    }
    Flags::try_parse_from(argv).unwrap().listen
}

async fn health(port: u16, tls: Option<ClientTlsConfig>) -> Result<i32, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Channel::from_shared(format!("{scheme}://localhost:{port}"))
        .unwrap()
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(std::time::Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|r| r.into_inner().status)
        .map_err(|e| format!("{e:?}"))
}

#[tokio::test]
async fn the_grpc_service_serves_mutual_tls_only_to_clients_with_a_certificate_of_its_ca() {
    let ours = pki("nodes");
    let dir = std::env::temp_dir().join(format!("tandem-node-tls-{}", std::process::id()));
    let listen = listen_args(&dir, &ours, true);
    assert_eq!(tls::scheme(&listen), "https");
    let config = tls::server_tls(&listen).unwrap().expect("TLS is on");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = server::spawn(
        listener,
        tonic::service::Routes::default(),
        "tandem.v1.Decode",
        Some(config),
    )
    .await
    .unwrap();

    let client = |cert: Option<(&str, &str)>, ca: &str| {
        let mut c = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .domain_name("localhost");
        if let Some((cert, key)) = cert {
            c = c.identity(Identity::from_pem(cert, key));
        }
        c
    };
    // With the CA and a client certificate it signed: SERVING (1).
    let ok = health(
        port,
        Some(client(
            Some((&ours.client_cert, &ours.client_key)),
            &ours.ca,
        )),
    )
    .await;
    assert_eq!(ok, Ok(1), "{ok:?}");
    // No client certificate, a certificate of another CA, plain text: refused.
    let theirs = pki("other");
    for (what, result) in [
        (
            "no client certificate",
            health(port, Some(client(None, &ours.ca))).await,
        ),
        (
            "another CA's certificate",
            health(
                port,
                Some(client(
                    Some((&theirs.client_cert, &theirs.client_key)),
                    &ours.ca,
                )),
            )
            .await,
        ),
        ("plain text", health(port, None).await),
    ] {
        assert!(result.is_err(), "{what} was served: {result:?}");
    }
    server
        .stop(std::time::Duration::from_secs(1))
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unusable_tls_files_stop_the_node_naming_flag_and_file() {
    let ours = pki("nodes");
    let dir = std::env::temp_dir().join(format!("tandem-node-tls-bad-{}", std::process::id()));
    let mut listen = listen_args(&dir, &ours, true);
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not pem").unwrap();
    listen.tls_client_ca = Some(junk.clone());
    let err = tls::server_tls(&listen).unwrap_err();
    assert!(
        matches!(&err, NodeError::InvalidConfig { flag: "--tls-client-ca", value, .. } if *value == junk.display().to_string()),
        "{err:?}"
    );
    listen.tls_client_ca = None;
    listen.tls_key = Some(dir.join("missing.pem"));
    let err = tls::server_tls(&listen).unwrap_err();
    assert!(err.to_string().contains("missing.pem"), "{err}");
    // Without --tls-cert: plain text, advertised as http.
    let plain = Flags::try_parse_from(["node"]).unwrap().listen;
    assert!(tls::server_tls(&plain).unwrap().is_none());
    assert_eq!(tls::scheme(&plain), "http");
    let _ = std::fs::remove_dir_all(&dir);
}
