//! Securing the wire (issue 5, item 4): HTTPS for the API (and the CLI
//! speaking it), mutual TLS for peer links, and the cluster secret every
//! peer must prove before it is served. Certificates are made here with
//! `rcgen`: a test CA, and leaves for `127.0.0.1` signed by it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fief::arbiter::LocalArbiter;
use fief::auth::{Auth, Identity};
use fief::core::PartitionCount;
use fief::http::ApiOptions;
use fief::tls::PeerTls;
use fief::{Instance, ModuleOptions, NodeConfig, TokioClock};
use fief_tests::{fief_cli, guests, node_with, test_config};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A test CA and the files it writes.
struct Pki {
    dir: tempfile::TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca }
    }

    fn ca_pem(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A leaf for `127.0.0.1` and `localhost`: (cert, key) PEM files.
    fn leaf(&self, name: &str) -> (PathBuf, PathBuf) {
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        let (cert_path, key_path) = (
            self.dir.path().join(format!("{name}.pem")),
            self.dir.path().join(format!("{name}.key")),
        );
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path)
    }

    fn peer_tls(&self, name: &str) -> PeerTls {
        let (cert, key) = self.leaf(name);
        PeerTls {
            cert,
            key,
            ca: self.ca_pem(),
        }
    }
}

/// Serve `node`'s API with `options`; the returned sender stops it.
async fn serve(
    node: Arc<Instance>,
    options: ApiOptions,
) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(fief::http::serve_with(node, listener, options, async {
        let _ = stopped.await;
    }));
    (addr, stop)
}

fn client_trusting(ca: &Path) -> reqwest::Client {
    let pem = std::fs::read(ca).unwrap();
    reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
        .build()
        .unwrap()
}

#[tokio::test]
async fn the_api_serves_https_and_refuses_plaintext() {
    let pki = Pki::new("api");
    let (cert, key) = pki.leaf("api");
    let node = Arc::new(node_with(&[("counter", guests::COUNTER)]).await);
    let options = ApiOptions {
        tls: Some(fief::tls::server_config(&cert, &key).unwrap()),
        ..ApiOptions::default()
    };
    let (addr, _stop) = serve(node, options).await;
    let client = client_trusting(&pki.ca_pem());
    let reply = client
        .post(format!("https://{addr}/v1/keys/counter/alice/call"))
        .body("incr")
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
    assert_eq!(reply.text().await.unwrap(), "1");
    // Plain HTTP on the same port gets no HTTP answer.
    let plain = reqwest::Client::new()
        .get(format!("http://{addr}/v1/status"))
        .timeout(Duration::from_secs(20))
        .send()
        .await;
    assert!(plain.is_err(), "plaintext was served: {plain:?}");
    // A client that does not trust the CA refuses the node.
    let untrusting = reqwest::Client::new()
        .get(format!("https://{addr}/v1/status"))
        .send()
        .await;
    assert!(untrusting.is_err(), "{untrusting:?}");
    // The server still serves after both.
    let status = client
        .get(format!("https://{addr}/v1/status"))
        .send()
        .await
        .unwrap();
    assert_eq!(status.status(), 200);
}

#[tokio::test]
async fn the_cli_speaks_https_with_a_token() {
    let pki = Pki::new("cli");
    let (cert, key) = pki.leaf("api");
    let node = Arc::new(node_with(&[]).await);
    let mut auth = Auth::open();
    auth.add_token("cli-admin-token-0123456789", Identity::Admin)
        .unwrap();
    let options = ApiOptions {
        auth: Arc::new(auth),
        tls: Some(fief::tls::server_config(&cert, &key).unwrap()),
    };
    let (addr, _stop) = serve(node, options).await;
    let url = format!("https://{addr}");
    let ca = pki.ca_pem();
    let ca = ca.to_str().unwrap();
    let cli = |args: &[&str]| {
        let out = fief_cli(args);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let deploy = [
        "deploy",
        guests::COUNTER,
        "--module",
        "counter",
        "--node",
        &url,
        "--ca-cert",
        ca,
        "--token",
        "cli-admin-token-0123456789",
    ];
    // The blocking CLI runs off the runtime, which serves the node.
    let (ok, out) = tokio::task::spawn_blocking({
        let deploy: Vec<String> = deploy.iter().map(|s| s.to_string()).collect();
        move || cli(&deploy.iter().map(String::as_str).collect::<Vec<_>>())
    })
    .await
    .unwrap();
    assert!(ok, "{out}");
    let url2 = url.clone();
    let ca2 = ca.to_owned();
    let (ok, out) = tokio::task::spawn_blocking(move || {
        cli(&[
            "call",
            "counter",
            "alice",
            "incr",
            "--node",
            &url2,
            "--ca-cert",
            &ca2,
            "--token",
            "cli-admin-token-0123456789",
        ])
    })
    .await
    .unwrap();
    assert!(ok && out.trim() == "1", "{out}");
    // Without the token: a clear 401.
    let (url3, ca3) = (url.clone(), ca.to_owned());
    let (ok, out) = tokio::task::spawn_blocking(move || {
        cli(&[
            "call",
            "counter",
            "alice",
            "incr",
            "--node",
            &url3,
            "--ca-cert",
            &ca3,
        ])
    })
    .await
    .unwrap();
    assert!(!ok && out.contains("401") && out.contains("token"), "{out}");
    // Without the CA: the certificate is not trusted.
    let (ok, out) = tokio::task::spawn_blocking(move || {
        cli(&[
            "status",
            "--node",
            &url,
            "--token",
            "cli-admin-token-0123456789",
        ])
    })
    .await
    .unwrap();
    assert!(!ok, "{out}");
}

// ---- peer links ----

/// Two nodes of one namespace on a shared arbiter, with `counter`, each
/// with its own configuration changes; `n0` starts first and so owns
/// every partition until it can hand some to `n1`.
async fn pair(
    namespace: &str,
    tweak: impl Fn(usize, &mut NodeConfig),
) -> Result<(Instance, Instance), fief::Error> {
    let config = |i: usize| {
        let mut c = NodeConfig {
            node_id: format!("{namespace}-n{i}"),
            namespace: namespace.to_owned(),
            partitions: 16,
            max_live_keys: 64,
            max_memory_per_key: fief::config::ByteSize::mib(64),
            ..test_config()
        };
        tweak(i, &mut c);
        c
    };
    let arbiter = LocalArbiter::new(
        Arc::new(TokioClock::new()),
        PartitionCount::new(16).unwrap(),
    );
    let mut nodes = Vec::new();
    for i in 0..2 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let node = Instance::builder(config(i))
            .arbiter(Arc::new(arbiter.clone()))
            .peer_listener(listener)
            .module(
                "counter",
                guests::bytes(guests::COUNTER),
                ModuleOptions::default(),
            )
            .start()
            .await?;
        nodes.push(node);
    }
    let n1 = nodes.pop().unwrap();
    let n0 = nodes.pop().unwrap();
    Ok((n0, n1))
}

/// Call 32 keys through `node`; the errors, as text.
async fn call_keys(node: &Instance) -> Vec<String> {
    let mut errors = Vec::new();
    for i in 0..32 {
        if let Err(e) = node
            .call("counter", &format!("k{i}"), b"incr".to_vec())
            .await
        {
            errors.push(e.to_string());
        }
    }
    errors
}

fn secret_file(dir: &Path, name: &str, secret: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, secret).unwrap();
    path
}

#[tokio::test]
async fn peers_must_prove_the_cluster_secret() {
    let dir = tempfile::tempdir().unwrap();
    let right = secret_file(dir.path(), "right", "the-cluster-secret-0123456789\n");
    let wrong = secret_file(dir.path(), "wrong", "another-secret-0123456789");

    // Both know the secret: every key answers through either node.
    let (n0, n1) = pair("secret-ok", |_, c| {
        c.cluster_secret_file = Some(right.clone())
    })
    .await
    .unwrap();
    assert_eq!(call_keys(&n1).await, Vec::<String>::new());
    assert_eq!(call_keys(&n0).await, Vec::<String>::new());
    n1.shutdown().await;
    n0.shutdown().await;

    // n1 has another secret: what it forwards to n0 is refused.
    let (n0, n1) = pair("secret-wrong", |i, c| {
        c.cluster_secret_file = Some(if i == 0 { right.clone() } else { wrong.clone() });
    })
    .await
    .unwrap();
    let errors = call_keys(&n1).await;
    assert!(
        errors.iter().any(|e| e.contains("cluster secret")),
        "{errors:?}"
    );
    // n0 serves its own keys as before.
    assert!(n0.call("counter", "mine", b"incr".to_vec()).await.is_ok());
    n1.shutdown().await;
    n0.shutdown().await;

    // n1 has no secret at all: refused too, saying so.
    let (n0, n1) = pair("secret-none", |i, c| {
        c.cluster_secret_file = (i == 0).then(|| right.clone());
    })
    .await
    .unwrap();
    let errors = call_keys(&n1).await;
    assert!(
        errors
            .iter()
            .any(|e| e.contains("requires the cluster secret")),
        "{errors:?}"
    );
    n1.shutdown().await;
    n0.shutdown().await;

    // A secret too short to be one stops the node at start.
    let short = secret_file(dir.path(), "short", "tiny");
    let err = match pair("secret-short", |_, c| {
        c.cluster_secret_file = Some(short.clone())
    })
    .await
    {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a 4-byte secret was accepted"),
    };
    assert!(err.contains("at least 16"), "{err}");
}

#[tokio::test]
async fn peer_links_run_over_mutual_tls_and_refuse_plaintext() {
    let pki = Pki::new("peers");
    let tls: Vec<PeerTls> = (0..2).map(|i| pki.peer_tls(&format!("n{i}"))).collect();

    let (n0, n1) = pair("tls-ok", |i, c| c.peer_tls = Some(tls[i].clone()))
        .await
        .unwrap();
    assert_eq!(call_keys(&n1).await, Vec::<String>::new());
    assert_eq!(call_keys(&n0).await, Vec::<String>::new());
    n1.shutdown().await;
    n0.shutdown().await;

    // n1 speaks plain TCP to n0's TLS listener: refused.
    let (n0, n1) = pair("tls-plain", |i, c| {
        c.peer_tls = (i == 0).then(|| tls[0].clone());
    })
    .await
    .unwrap();
    let errors = call_keys(&n1).await;
    assert!(!errors.is_empty(), "a plaintext peer was served");
    assert!(
        errors.iter().all(|e| e.contains("could not be reached")),
        "{errors:?}"
    );
    n1.shutdown().await;
    n0.shutdown().await;

    // n1's certificate is from another CA: refused.
    let stranger = Pki::new("stranger");
    let (n0, n1) = pair("tls-stranger", |i, c| {
        c.peer_tls = Some(if i == 0 {
            tls[0].clone()
        } else {
            stranger.peer_tls("n1")
        });
    })
    .await
    .unwrap();
    let errors = call_keys(&n1).await;
    assert!(errors.iter().any(|e| e.contains("TLS")), "{errors:?}");
    n1.shutdown().await;
    n0.shutdown().await;
}
