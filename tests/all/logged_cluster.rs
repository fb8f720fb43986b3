//! A cluster of real `fief node` processes that each write an event log,
//! under a steady load of calls and casts, judged at the end by the history
//! checker (`fief_tests::history`): for the arbiter fault tests
//! (`arbiter_regression.rs`, `etcd_faults.rs`). It starts, restarts and
//! kills processes and remembers each one's log; the faults are the tests'.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fief_tests::history::{self, NodeRun, Note, Summary};
use fief_tests::multiprocess::{ClusterNode, NodeSpec, call_url, post_key};
use fief_tests::{free_port, guests};
use tokio::task::JoinHandle;

/// Keys the load spreads over (`k0` … `k15`).
pub(crate) const KEYS: usize = 16;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const START_LIMIT: Duration = Duration::from_secs(40);

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The nodes, their event logs, and what the test did.
pub(crate) struct LoggedCluster {
    dir: tempfile::TempDir,
    namespace: String,
    arbiter: String,
    /// Arguments every node gets (timings, `--storage`).
    args: Vec<String>,
    peer_ports: Vec<u16>,
    pub(crate) nodes: Vec<ClusterNode>,
    /// (label, event log, when known gone) per process.
    runs: Vec<(String, PathBuf, Option<u64>)>,
    notes: Vec<Note>,
    started: Instant,
}

impl LoggedCluster {
    /// A cluster of up to `size` nodes of `namespace` on `arbiter`, each
    /// started with `args`; none runs yet.
    pub(crate) fn new(size: usize, namespace: String, arbiter: String, args: &[&str]) -> Self {
        LoggedCluster {
            dir: tempfile::tempdir().expect("a directory for the event logs"),
            namespace,
            arbiter,
            args: args.iter().map(|s| (*s).to_owned()).collect(),
            peer_ports: (0..size).map(|_| free_port()).collect(),
            nodes: Vec::new(),
            runs: Vec::new(),
            notes: Vec::new(),
            started: Instant::now(),
        }
    }

    /// Print `text` with the time since the start, and keep it for the
    /// history's traces.
    pub(crate) fn note(&mut self, text: impl Into<String>) {
        let text = text.into();
        println!("{:>6.2}s: {text}", self.started.elapsed().as_secs_f64());
        self.notes.push(Note {
            t_us: now_us(),
            text,
        });
    }

    /// Start node `i` (`n{i+1}`, with the `probe` module) and wait until its
    /// lease is current; a new process of it if it ran before.
    pub(crate) async fn spawn(&mut self, i: usize) {
        let label = format!("n{}#{}", i + 1, self.runs.len());
        let log = self.dir.path().join(format!("{label}.events.jsonl"));
        let mut extra_args = self.args.clone();
        extra_args.extend(["--event-log".to_owned(), log.display().to_string()]);
        let spec = NodeSpec {
            node_id: format!("n{}", i + 1),
            namespace: self.namespace.clone(),
            arbiter: self.arbiter.clone(),
            deploy: vec![("probe".to_owned(), guests::PROBE.to_owned())],
            extra_args,
        };
        let peer = format!("127.0.0.1:{}", self.peer_ports[i]);
        let mut node = ClusterNode::spawn_with_peer_listen(&spec, &peer).await;
        node.wait_current(START_LIMIT).await;
        if i < self.nodes.len() {
            drop(std::mem::replace(&mut self.nodes[i], node));
        } else {
            self.nodes.push(node);
        }
        self.runs.push((label.clone(), log, None));
        self.note(format!("{label} started"));
    }

    /// SIGKILL every process; each one's run is closed.
    pub(crate) fn kill_all(&mut self) {
        for node in &mut self.nodes {
            node.kill9();
        }
        let gone = now_us();
        for run in &mut self.runs {
            run.2.get_or_insert(gone);
        }
        self.note("every node SIGKILLed");
    }

    /// Processes started so far (to split the history in eras).
    pub(crate) fn runs_so_far(&self) -> usize {
        self.runs.len()
    }

    /// Every node's status (`null` for one that does not answer).
    pub(crate) async fn statuses(&self) -> Vec<serde_json::Value> {
        let mut all = Vec::new();
        for node in &self.nodes {
            all.push(node.status().await.unwrap_or_default());
        }
        all
    }

    /// The nodes' HTTP addresses.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url.clone()).collect()
    }

    /// Judge the history of the processes `runs` so far without stopping
    /// anything (their runs must have ended: see [`Self::kill_all`]).
    pub(crate) fn judge(&self, runs: std::ops::Range<usize>) -> Summary {
        let runs: Vec<NodeRun> = self.runs[runs]
            .iter()
            .map(|(label, log, gone)| NodeRun::read(label, log, *gone))
            .collect();
        history::assert_single_ownership(&runs, &self.notes)
    }
}

/// Calls (`echo`) and casts (`record`) over [`KEYS`] keys through every
/// node, each message unique, until stopped; counts the answers.
pub(crate) struct Load {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Load {
    /// Start a load through `urls`; `tag` tells one load's messages from
    /// another's (a message processed twice is a violation).
    pub(crate) fn start(tag: &'static str, urls: Vec<String>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(run_load(tag, urls, stop.clone(), answered.clone()));
        Load {
            stop,
            answered,
            task,
        }
    }

    /// Requests answered so far.
    pub(crate) fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    /// How many requests are answered within `window`.
    pub(crate) async fn answered_within(&self, window: Duration) -> u64 {
        let before = self.answered();
        tokio::time::sleep(window).await;
        self.answered() - before
    }

    /// Stop, and wait for the last request.
    pub(crate) async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let answered = self.answered.clone();
        self.task.await.expect("the load task");
        answered.load(Ordering::Relaxed)
    }
}

async fn run_load(tag: &'static str, urls: Vec<String>, stop: Arc<AtomicBool>, ok: Arc<AtomicU64>) {
    let client = reqwest::Client::new();
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let (key, url) = (format!("k{}", n % KEYS), &urls[n % urls.len()]);
        let answered = if n.is_multiple_of(4) {
            let message = format!("record {tag}{n}");
            post_key(
                &client,
                url,
                "probe",
                &key,
                "cast",
                &message,
                REQUEST_TIMEOUT,
            )
            .await
            .is_ok()
        } else {
            let message = format!("echo {tag}{n}");
            call_url(&client, url, "probe", &key, &message, REQUEST_TIMEOUT)
                .await
                .is_ok()
        };
        if answered {
            ok.fetch_add(1, Ordering::Relaxed);
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
