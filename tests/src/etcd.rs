//! A real etcd cluster for the etcd arbiter's tests: N `etcd` processes
//! (`/usr/bin/etcd`, Debian's `etcd-server`; `scripts/install-test-deps.sh`
//! installs it) on loopback, client and peer ports ephemeral and free
//! (never 2379/2380, where the package's system etcd listens), data
//! directories in a temporary directory, logs under `target/test-logs/`.
//!
//! A test can stop, kill, pause (SIGSTOP) and resume (SIGCONT) one member,
//! find the raft leader (`/v3/maintenance/status`), and stop every member
//! and start them again on the same data. Every member is killed when the
//! cluster is dropped (also when a test panics; then the logs are kept and
//! their tails printed).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

/// Where Debian's `etcd-server` puts the server.
pub const ETCD_BIN: &str = "/usr/bin/etcd";

/// How long a cluster may take to start or heal (an election, a restart).
const HEALTHY_WITHIN: Duration = Duration::from_secs(30);

struct EtcdMember {
    name: String,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// A running etcd cluster of real processes.
pub struct EtcdCluster {
    _dir: tempfile::TempDir,
    token: String,
    members: Vec<EtcdMember>,
    client: reqwest::Client,
}

/// `n` distinct free loopback ports, none of etcd's well-known ones.
fn free_ports(n: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    while ports.len() < n {
        let port = crate::free_port();
        if !ports.contains(&port) && !(2379..=2380).contains(&port) {
            ports.push(port);
        }
    }
    ports
}

impl EtcdCluster {
    /// Start a cluster of `members` members and wait until it has a leader
    /// and serves a linearizable read. Panics, saying what to install, if
    /// there is no `etcd`.
    pub async fn start(members: usize) -> EtcdCluster {
        assert!(
            std::path::Path::new(ETCD_BIN).exists(),
            "{ETCD_BIN} is missing: the etcd arbiter's tests run a real etcd cluster. Install \
             Debian's etcd-server (./scripts/install-test-deps.sh does)"
        );
        static CLUSTERS: AtomicU64 = AtomicU64::new(0);
        let token = format!(
            "fief-test-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        );
        let dir = tempfile::tempdir().expect("a temporary directory for etcd's data");
        let ports = free_ports(members * 2);
        let members = (0..members)
            .map(|i| EtcdMember {
                name: format!("m{i}"),
                client_port: ports[2 * i],
                peer_port: ports[2 * i + 1],
                data_dir: dir.path().join(format!("m{i}")),
                log: crate::test_logs_dir().join(format!("etcd-{token}-m{i}.log")),
                child: None,
            })
            .collect();
        let mut cluster = EtcdCluster {
            _dir: dir,
            token,
            members,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .no_proxy()
                .build()
                .expect("an HTTP client"),
        };
        for i in 0..cluster.members.len() {
            cluster.spawn(i);
        }
        cluster.wait_healthy().await;
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let initial_cluster = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let m = &mut self.members[i];
        assert!(m.child.is_none(), "etcd member {i} is running already");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .expect("creating an etcd log file");
        let client_url = format!("http://127.0.0.1:{}", m.client_port);
        let peer_url = format!("http://127.0.0.1:{}", m.peer_port);
        let child = Command::new(ETCD_BIN)
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &initial_cluster])
            .args(["--initial-cluster-token", &self.token])
            .args(["--initial-cluster-state", "new"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            // Environment settings of a system etcd must not leak in.
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("cloning the log file handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {ETCD_BIN}: {e}"));
        m.child = Some(child);
    }

    /// How many members the cluster has (running or not).
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the cluster has no members.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `i`'s client endpoint, `127.0.0.1:<port>`.
    pub fn endpoint(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.members[i].client_port)
    }

    /// The arbiter URL of every member, keys under `prefix`:
    /// `etcd://127.0.0.1:<p0>,127.0.0.1:<p1>,…/<prefix>`.
    pub fn url(&self, prefix: &str) -> String {
        let endpoints: Vec<String> = (0..self.len()).map(|i| self.endpoint(i)).collect();
        format!(
            "etcd://{}/{}",
            endpoints.join(","),
            prefix.trim_start_matches('/')
        )
    }

    fn pid(&self, i: usize) -> u32 {
        self.members[i]
            .child
            .as_ref()
            .unwrap_or_else(|| panic!("etcd member {i} is not running"))
            .id()
    }

    fn signal(&self, i: usize, signal: &str) {
        crate::send_signal(self.pid(i), signal, &format!("etcd m{i}"));
    }

    /// Stop member `i` gracefully (SIGTERM) and reap it.
    pub fn stop(&mut self, i: usize) {
        self.signal(i, "TERM");
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.wait();
        }
    }

    /// Kill member `i` (SIGKILL) and reap it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freeze member `i` (SIGSTOP): its sockets stay open and answer
    /// nothing.
    pub fn pause(&self, i: usize) {
        self.signal(i, "STOP");
    }

    /// Thaw member `i` (SIGCONT).
    pub fn resume(&self, i: usize) {
        self.signal(i, "CONT");
    }

    /// Start member `i` again on its data (after [`EtcdCluster::stop`] or
    /// [`EtcdCluster::kill`]) and wait until the cluster is healthy.
    pub async fn restart(&mut self, i: usize) {
        self.spawn(i);
        self.wait_healthy().await;
    }

    /// Stop every member (SIGTERM).
    pub fn stop_all(&mut self) {
        for i in 0..self.len() {
            if self.members[i].child.is_some() {
                self.stop(i);
            }
        }
    }

    /// Start every stopped member again on its data and wait until the
    /// cluster is healthy.
    pub async fn start_all(&mut self) {
        for i in 0..self.len() {
            if self.members[i].child.is_none() {
                self.spawn(i);
            }
        }
        self.wait_healthy().await;
    }

    async fn post(&self, i: usize, path: &str, body: &Value) -> Option<Value> {
        let url = format!("http://{}{path}", self.endpoint(i));
        let answer = self.client.post(url).json(body).send().await.ok()?;
        if !answer.status().is_success() {
            return None;
        }
        answer.json().await.ok()
    }

    /// Member `i`'s id and the raft leader's id as it knows them.
    async fn status(&self, i: usize) -> Option<(String, String)> {
        let status = self.post(i, "/v3/maintenance/status", &json!({})).await?;
        let me = status["header"]["member_id"].as_str()?.to_owned();
        let leader = status["leader"].as_str().unwrap_or("0").to_owned();
        Some((me, leader))
    }

    /// The member that is the raft leader, as the running members report
    /// it (`None` if none answers or they know no leader).
    pub async fn leader(&self) -> Option<usize> {
        let mut statuses = Vec::new();
        for i in 0..self.len() {
            statuses.push(if self.members[i].child.is_some() {
                self.status(i).await
            } else {
                None
            });
        }
        let leader = statuses
            .iter()
            .flatten()
            .map(|(_, leader)| leader)
            .find(|leader| *leader != "0")?
            .clone();
        statuses
            .iter()
            .position(|s| s.as_ref().is_some_and(|(me, _)| *me == leader))
    }

    /// Wait until the running members agree on a leader and one of them
    /// serves a linearizable read; panics, with the logs' tails, after
    /// [`HEALTHY_WITHIN`].
    pub async fn wait_healthy(&self) {
        let deadline = tokio::time::Instant::now() + HEALTHY_WITHIN;
        loop {
            if self.healthy().await {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "the etcd cluster {} is not healthy after {HEALTHY_WITHIN:?}:\n{}",
                    self.token,
                    self.log_tails(15)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn healthy(&self) -> bool {
        let mut leaders = Vec::new();
        let mut reader = None;
        for i in 0..self.len() {
            if self.members[i].child.is_none() {
                continue;
            }
            match self.status(i).await {
                Some((_, leader)) if leader != "0" => {
                    leaders.push(leader);
                    reader.get_or_insert(i);
                }
                _ => return false,
            }
        }
        leaders.dedup();
        let Some(reader) = reader else {
            return false;
        };
        leaders.len() == 1
            && self
                .post(reader, "/v3/kv/range", &json!({"key": "aGVhbHRo"}))
                .await
                .is_some()
    }

    /// The last `lines` lines of every member's log.
    pub fn log_tails(&self, lines: usize) -> String {
        self.members
            .iter()
            .map(|m| {
                let text = std::fs::read_to_string(&m.log).unwrap_or_default();
                let all: Vec<&str> = text.lines().collect();
                format!(
                    "---- etcd {} ({}):\n{}",
                    m.name,
                    m.log.display(),
                    all[all.len().saturating_sub(lines)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut child) = m.child.take() {
                // A paused member dies of SIGKILL too.
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if std::thread::panicking() {
            eprintln!("{}", self.log_tails(20));
            eprintln!("{}", crate::failure::why_the_test_failed());
        } else {
            for m in &self.members {
                let _ = std::fs::remove_file(&m.log);
            }
        }
    }
}
