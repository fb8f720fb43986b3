//! The node's event log: a JSON-lines record of what a single-ownership
//! checker needs to judge a run after the fact (`fief node --event-log FILE`).
//!
//! Besides key lives ([`KeyLife`]: a key process started, ended), a node
//! reports [`NodeEvent`]s to an observer installed with
//! [`InstanceBuilder::events`](crate::InstanceBuilder::events): a lease
//! granted, a fence (with the fence point it crossed), and each routed message
//! handed to a key's guest. [`EventLog`] writes both to a file, one
//! [`EventRecord`] per line, stamped with wall-clock microseconds so that the
//! logs of several node processes on one machine can be merged on one time
//! line (`tests/all/chaos.rs` does, and `fief_tests::history` checks them).
//!
//! Each line is written with one `write` call as it happens (no buffering), so
//! a node killed with SIGKILL loses nothing it reported, and a paused node's
//! lines up to the pause can be read. The file is appended to; each process
//! starts its part with an `opened` line naming its process id.
//!
//! Message contents are not logged, only a digest (FNV-1a 64, hex), which is
//! enough to tell whether one message was processed twice.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::key::{Envelope, KeyEnv, KeyLife, KeyLifeEvent, KeyLifeObserver, KeyServices, Via};

/// Something a node did that a single-ownership checker needs, besides key
/// lives; reported to the observer installed with
/// [`InstanceBuilder::events`](crate::InstanceBuilder::events).
#[derive(Clone, Debug)]
pub struct NodeEvent {
    /// The node.
    pub node: String,
    /// When, on this process's monotonic clock.
    pub at: Instant,
    /// What happened.
    pub kind: NodeEventKind,
}

/// What a [`NodeEvent`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeEventKind {
    /// The arbiter granted the node a fresh lease: from now until its next
    /// fence it may serve what the table gives it.
    LeaseGranted {
        /// The lease's id at the arbiter.
        lease: u64,
    },
    /// The node fenced. From `fence_point` on it acts for nothing until it
    /// is granted a new lease: `fence_point` is the fence point of its lease,
    /// or the instant of the fence if that came first (the arbiter refused a
    /// renewal, the coordination crashed, an operator fenced it). Reported
    /// when the fence is carried out, which after a pause (SIGSTOP, a frozen
    /// VM) can be long after `fence_point`.
    Fenced {
        /// The first instant at which the node could no longer act.
        fence_point: Instant,
        /// Why it fenced.
        cause: String,
    },
    /// A routed message (a call or a cast, whichever node it arrived on)
    /// passed its key's fence check and is handed to the guest. The event's
    /// instant is read just *before* that check, so a node paused between
    /// the check and the guest cannot date the message past the fence point
    /// the check saw as ahead.
    Processing {
        /// The module.
        module: String,
        /// The key.
        key: String,
        /// The ownership token of the key's partition on this node.
        token: u64,
        /// Call or cast.
        kind: MessageKind,
        /// FNV-1a 64 of the message's bytes.
        digest: u64,
    },
}

/// Which kind of routed message a [`NodeEventKind::Processing`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageKind {
    /// A call (the caller waits for a reply).
    Call,
    /// A cast (one-way).
    Cast,
}

/// Receives a node's [`NodeEvent`]s.
pub type NodeEventObserver = Arc<dyn Fn(NodeEvent) + Send + Sync>;

/// Report a routed message (a call routed to its key, or a cast) that passed
/// its key's fence check at `checked_at` as [`NodeEventKind::Processing`];
/// anything else the key loop takes (timers, pub/sub, local handles, stops)
/// is not reported. Called by the key loop just before the guest gets it.
pub(crate) fn report_processing(
    services: &KeyServices,
    env: &KeyEnv,
    envelope: &Envelope,
    checked_at: Instant,
) {
    let (kind, message) = match envelope {
        Envelope::Call {
            message,
            via: Via::Routed,
            ..
        } => (MessageKind::Call, message),
        Envelope::Cast { message, .. } => (MessageKind::Cast, message),
        _ => return,
    };
    report_routed(services, env, kind, message, checked_at);
}

/// Report a routed call that runs inline, on its caller's task (the key was
/// idle), and passed the fence check at `checked_at`, as
/// [`NodeEventKind::Processing`], like the key loop's [`report_processing`].
pub(crate) fn report_inline_call(
    services: &KeyServices,
    env: &KeyEnv,
    message: &[u8],
    checked_at: Instant,
) {
    report_routed(services, env, MessageKind::Call, message, checked_at);
}

fn report_routed(
    services: &KeyServices,
    env: &KeyEnv,
    kind: MessageKind,
    message: &[u8],
    checked_at: Instant,
) {
    services.report(
        checked_at,
        NodeEventKind::Processing {
            module: env.module.to_string(),
            key: env.key.to_string(),
            token: env.token.0,
            kind,
            digest: fief_core::partition::fnv1a64(message),
        },
    );
}

/// One line of an event log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventRecord {
    /// When, in wall-clock microseconds since the Unix epoch (the process's
    /// monotonic instant mapped through one reading of both clocks taken when
    /// the log was opened, so one process's lines keep their order even if
    /// the wall clock is stepped).
    pub t_us: u64,
    /// The node.
    pub node: String,
    /// What happened.
    #[serde(flatten)]
    pub event: RecordedEvent,
}

/// What an [`EventRecord`] reports (`"event": "<name>"` in the JSON line).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RecordedEvent {
    /// A process opened the log (its first line).
    Opened {
        /// The process id.
        pid: u32,
    },
    /// A key process is about to be created ([`KeyLifeEvent::Started`]).
    KeyStarted {
        /// The module.
        module: String,
        /// The key.
        key: String,
    },
    /// A key process's store was dropped ([`KeyLifeEvent::Ended`]).
    KeyEnded {
        /// The module.
        module: String,
        /// The key.
        key: String,
    },
    /// [`NodeEventKind::Processing`].
    Processing {
        /// The module.
        module: String,
        /// The key.
        key: String,
        /// The ownership token of the key's partition on this node.
        token: u64,
        /// Call or cast.
        kind: MessageKind,
        /// FNV-1a 64 of the message's bytes, 16 hex digits.
        digest: String,
    },
    /// [`NodeEventKind::LeaseGranted`].
    LeaseGranted {
        /// The lease's id at the arbiter.
        lease: u64,
    },
    /// [`NodeEventKind::Fenced`]; the line's `t_us` is when the fence was
    /// carried out.
    Fenced {
        /// The fence point, wall-clock microseconds since the Unix epoch.
        fence_point_us: u64,
        /// Why it fenced.
        cause: String,
    },
}

/// Writes a node's key lives and [`NodeEvent`]s to a file as JSON lines.
pub struct EventLog {
    file: Mutex<File>,
    /// One reading of both clocks: maps monotonic instants to wall time.
    anchor: (Instant, SystemTime),
    /// Whether a failed write was already logged (it is logged once).
    write_failed: AtomicBool,
}

impl EventLog {
    /// Open (create or append to) `path` and write the `opened` line.
    ///
    /// # Errors
    ///
    /// The file cannot be opened or written.
    pub fn open(path: &Path, node: &str) -> std::io::Result<Arc<EventLog>> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let log = Arc::new(EventLog {
            file: Mutex::new(file),
            anchor: (Instant::now(), SystemTime::now()),
            write_failed: AtomicBool::new(false),
        });
        let opened = log.line(
            Instant::now(),
            node,
            RecordedEvent::Opened {
                pid: std::process::id(),
            },
        );
        log.file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .write_all(opened.as_bytes())?;
        Ok(log)
    }

    /// An observer of key lives that writes them to this log
    /// ([`InstanceBuilder::observer`](crate::InstanceBuilder::observer)).
    pub fn key_life_observer(self: &Arc<Self>) -> KeyLifeObserver {
        let log = self.clone();
        Arc::new(move |life: KeyLife| {
            let (module, key) = (life.module, life.key);
            let event = match life.event {
                KeyLifeEvent::Started => RecordedEvent::KeyStarted { module, key },
                KeyLifeEvent::Ended => RecordedEvent::KeyEnded { module, key },
            };
            log.write(life.at, &life.node, event);
        })
    }

    /// An observer of [`NodeEvent`]s that writes them to this log
    /// ([`InstanceBuilder::events`](crate::InstanceBuilder::events)).
    pub fn node_event_observer(self: &Arc<Self>) -> NodeEventObserver {
        let log = self.clone();
        Arc::new(move |event: NodeEvent| {
            let recorded = match event.kind {
                NodeEventKind::LeaseGranted { lease } => RecordedEvent::LeaseGranted { lease },
                NodeEventKind::Fenced { fence_point, cause } => RecordedEvent::Fenced {
                    fence_point_us: log.wall_us(fence_point),
                    cause,
                },
                NodeEventKind::Processing {
                    module,
                    key,
                    token,
                    kind,
                    digest,
                } => RecordedEvent::Processing {
                    module,
                    key,
                    token,
                    kind,
                    digest: format!("{digest:016x}"),
                },
            };
            log.write(event.at, &event.node, recorded);
        })
    }

    /// `at` in wall-clock microseconds since the Unix epoch.
    fn wall_us(&self, at: Instant) -> u64 {
        let (mono, wall) = self.anchor;
        let wall = if at >= mono {
            wall + (at - mono)
        } else {
            wall - (mono - at)
        };
        wall.duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    /// One JSON line, newline included.
    fn line(&self, at: Instant, node: &str, event: RecordedEvent) -> String {
        let record = EventRecord {
            t_us: self.wall_us(at),
            node: node.to_owned(),
            event,
        };
        let mut line = serde_json::to_string(&record).unwrap_or_default();
        line.push('\n');
        line
    }

    fn write(&self, at: Instant, node: &str, event: RecordedEvent) {
        let line = self.line(at, node, event);
        let written = self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .write_all(line.as_bytes());
        if let Err(error) = written
            && !self.write_failed.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(%error, "cannot write the event log; later failures are not logged");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_as_one_json_line_each() {
        let dir = tempfile_dir();
        let path = dir.join("events.jsonl");
        let log = EventLog::open(&path, "n1").expect("opening the log");
        let now = Instant::now();
        (log.key_life_observer())(KeyLife {
            node: "n1".to_owned(),
            module: "counter".to_owned(),
            key: "alice".to_owned(),
            event: KeyLifeEvent::Started,
            at: now,
        });
        (log.node_event_observer())(NodeEvent {
            node: "n1".to_owned(),
            at: now + std::time::Duration::from_millis(5),
            kind: NodeEventKind::Fenced {
                fence_point: now + std::time::Duration::from_millis(2),
                cause: "test".to_owned(),
            },
        });
        let text = std::fs::read_to_string(&path).expect("reading the log");
        let records: Vec<EventRecord> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("a record per line"))
            .collect();
        assert_eq!(records.len(), 3, "{text}");
        assert!(matches!(records[0].event, RecordedEvent::Opened { .. }));
        assert_eq!(
            records[1].event,
            RecordedEvent::KeyStarted {
                module: "counter".to_owned(),
                key: "alice".to_owned()
            }
        );
        let RecordedEvent::Fenced { fence_point_us, .. } = records[2].event else {
            panic!("expected a fence: {text}");
        };
        assert_eq!(records[2].t_us - records[1].t_us, 5_000);
        assert_eq!(fence_point_us - records[1].t_us, 2_000);
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "fief-event-log-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).expect("creating a temp dir");
        dir
    }
}
