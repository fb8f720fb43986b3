//! Schemathesis against a live node (issue 22 item 2): every operation of
//! the OpenAPI document (`GET /v1/openapi.json`, [`fief::openapi`]) fuzzed
//! from its schema, open and with a tenant's token, and every check on: no
//! `5xx`, no answer that breaks the document (status, content type, body,
//! headers), no schema-valid request refused and no schema-violating one
//! accepted, `405` with `Allow` for methods a route does not take, links
//! followed in a stateful phase (call → kill → call, cache write → read →
//! delete, module → rollback).
//!
//! `POST /v1/leave` is left out: it stops the node. Undeploy is pinned to a
//! module of its own (`tests/schemathesis/schemathesis.toml` says why, with
//! the other settings). The seed is fixed, so a run is reproducible;
//! `FIEF_SCHEMATHESIS_SEED` picks another and `FIEF_SCHEMATHESIS_EXAMPLES`
//! more cases per operation, to explore. Schemathesis comes from
//! `scripts/install-test-tools.sh` (`./scripts/test.sh` runs it first); without it
//! these tests fail, naming the script.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fief_tests::{fief_command, free_port, guests, test_logs_dir, workspace_root};

/// Cases per operation and phase: bounded so both runs take well under a
/// minute each on two cores.
const EXAMPLES: u32 = 100;
/// The seed of a run.
const SEED: u64 = 22;

/// A `fief node` child with an embedded arbiter and store, killed when
/// dropped. Waits on `GET /v1/ready`, which needs no token.
struct Node {
    child: Child,
    port: u16,
    url: String,
    log: PathBuf,
    _data: tempfile::TempDir,
}

impl Node {
    fn start(extra: &[&str]) -> Node {
        let data = tempfile::tempdir().expect("a data directory");
        let port = free_port();
        let url = format!("http://127.0.0.1:{port}");
        let log = test_logs_dir().join(format!("schemathesis-node-{port}.log"));
        let file = std::fs::File::create(&log).expect("the node's log");
        let child = fief_command()
            .args(["node", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(data.path())
            .args(extra)
            .env("RUST_LOG", "info")
            .env_remove("FIEF_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("starting fief node");
        let mut node = Node {
            child,
            port,
            url,
            log,
            _data: data,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if ready(port) {
                return node;
            }
            if let Ok(Some(exit)) = node.child.try_wait() {
                panic!("fief node exited ({exit}): {}", node.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "fief node not ready within 60 s: {}",
                node.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// `.test-tools/schemathesis/bin/schemathesis`, or a failure naming the
/// script that installs it.
fn schemathesis() -> PathBuf {
    let dir = std::env::var_os("FIEF_TEST_TOOLS")
        .map_or_else(|| workspace_root().join(".test-tools"), PathBuf::from);
    let bin = dir.join("schemathesis/bin/schemathesis");
    assert!(
        bin.exists(),
        "{} is missing: run scripts/install-test-tools.sh (./scripts/test.sh runs it)",
        bin.display()
    );
    bin
}

/// `--deploy` arguments for `counter`, `stored` (durable state) and
/// `scratch` (the one undeploy removes), under `prefix` (`acme/` for a
/// tenant's).
fn deploys(prefix: &str) -> Vec<String> {
    [
        ("counter", guests::COUNTER),
        ("stored", guests::STORED_COUNTER),
        ("scratch", guests::COUNTER),
    ]
    .iter()
    .flat_map(|(name, path)| ["--deploy".to_owned(), format!("{prefix}{name}={path}")])
    .collect()
}

/// Run Schemathesis on `node` with `extra` arguments; panics with its whole
/// output unless it passes.
fn run(node: &Node, extra: &[&str]) {
    let seed = std::env::var("FIEF_SCHEMATHESIS_SEED").unwrap_or_else(|_| SEED.to_string());
    let examples =
        std::env::var("FIEF_SCHEMATHESIS_EXAMPLES").unwrap_or_else(|_| EXAMPLES.to_string());
    let config = workspace_root().join("tests/schemathesis/schemathesis.toml");
    // Hypothesis writes its files under the working directory.
    let scratch = tempfile::tempdir().expect("a working directory");
    // The document as the node serves it, from a file: given its URL,
    // Schemathesis leaves that URL's own operation out of the run.
    let (status, document) = http_get(node.port, "/v1/openapi.json").expect("the document");
    assert_eq!(status, 200, "GET /v1/openapi.json: {document}");
    let document_path = scratch.path().join("openapi.json");
    std::fs::write(&document_path, document).expect("writing the document");
    let started = Instant::now();
    let output = Command::new(schemathesis())
        .arg("--config-file")
        .arg(&config)
        .arg("run")
        .arg(&document_path)
        .args(["--url", &node.url])
        .args(["--checks", "all"])
        .args(["--exclude-path", "/v1/leave"])
        .args(["--max-examples", &examples, "--seed", &seed])
        .args(["--workers", "2", "--request-timeout", "20"])
        .args(["--generation-database", "none", "--no-color"])
        .args(extra)
        .current_dir(scratch.path())
        .env("NO_COLOR", "1")
        .output()
        .expect("running schemathesis");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "schemathesis failed ({}; seed {seed}, {examples} examples); the node's log is {}:\n{text}",
        output.status,
        node.log.display()
    );
    // Not a silent pass: every operation but the leave was tested.
    let total = fief::openapi::operations().len();
    let selected = format!("Selected: {}/{total}", total - 1);
    let tested = format!("Tested: {}", total - 1);
    assert!(
        text.contains(&selected) && text.contains(&tested),
        "schemathesis did not test every operation but POST /v1/leave ({selected}, {tested}):\n{text}"
    );
    eprintln!(
        "schemathesis passed in {:.1} s (seed {seed}, {examples} examples):\n{}",
        started.elapsed().as_secs_f64(),
        text.lines()
            .skip_while(|l| !l.contains("SUMMARY"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Issue 22 item 2, an open node: every operation, every check.
#[test]
fn schemathesis_passes_on_an_open_node() {
    let args = deploys("");
    let node = Node::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    run(&node, &[]);
}

/// Issue 22 item 2, a node with tokens, called with a tenant's: the same,
/// scoped to the tenant (its modules, its cache; `403` for the admin's
/// routes, which the document says).
#[test]
fn schemathesis_passes_with_a_tenant_token() {
    let dir = tempfile::tempdir().expect("a directory for the tokens file");
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        "[admin]\ntokens = [\"admin-token-for-schemathesis\"]\n\
         [tenants.acme]\ntokens = [\"acme-token-for-schemathesis\"]\n",
    )
    .expect("writing the tokens file");
    let mut args = vec!["--tokens".to_owned(), path_text(&tokens)];
    args.extend(deploys("acme/"));
    let node = Node::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    run(
        &node,
        &[
            "--header",
            "Authorization: Bearer acme-token-for-schemathesis",
        ],
    );
}

/// `GET path` on `127.0.0.1:port`: the status and the body, or `None`.
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Whether `GET /v1/ready` on `127.0.0.1:port` answers `200`.
fn ready(port: u16) -> bool {
    http_get(port, "/v1/ready").is_some_and(|(status, _)| status == 200)
}

fn path_text(path: &Path) -> String {
    path.to_str().expect("a UTF-8 path").to_owned()
}
