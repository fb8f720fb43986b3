//! The single-ownership checker (contract §5, last paragraph; guarantee 1):
//! record every key process's life interval on a common clock, from every
//! node, and fail on any overlap of two lives of one `(module, key)`, on two
//! nodes or on one.
//!
//! The nodes of a [`crate::cluster::Cluster`] run in one process, so the
//! [`KeyLife`] instants (`std::time::Instant`) they report are on one common
//! monotonic clock. A life starts at its `Started` event (reported before the
//! store exists) and ends at its `Ended` event (reported after the store was
//! dropped), so the interval covers every instant at which the process could
//! run guest code or act. A life that has not ended extends to the end of
//! the record.
//!
//! Included by `cluster.rs` (`cluster::ownership_checker`), so that
//! `cargo test --test all cluster` runs its own tests too.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use fief::{KeyLife, KeyLifeEvent, KeyLifeObserver};

/// Collects the key life events of every node it is installed on.
#[derive(Clone, Default)]
pub struct LifeRecorder {
    events: Arc<Mutex<Vec<KeyLife>>>,
}

impl LifeRecorder {
    /// An observer to install on a node (`InstanceBuilder::observer`).
    pub fn observer(&self) -> KeyLifeObserver {
        let events = self.events.clone();
        Arc::new(move |life: KeyLife| {
            events
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(life);
        })
    }

    /// Every event recorded so far, in recording order.
    pub fn events(&self) -> Vec<KeyLife> {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The nodes on which `module`/`key` had a life that started, per the
    /// record, in start order (a node appears once per life).
    pub fn started_on(&self, module: &str, key: &str) -> Vec<String> {
        let mut events: Vec<KeyLife> = self
            .events()
            .into_iter()
            .filter(|e| e.module == module && e.key == key && e.event == KeyLifeEvent::Started)
            .collect();
        events.sort_by_key(|e| e.at);
        events.into_iter().map(|e| e.node).collect()
    }
}

/// What a clean record contained.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Lives (started processes) checked.
    pub lives: usize,
    /// Distinct `(module, key)` pairs.
    pub keys: usize,
}

/// A breach of single ownership found in a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// A life of `module`/`key` started on `second` while a life of the same
    /// key was still running on `first` (`first == second` for two lives on
    /// one node).
    Overlap {
        /// The module.
        module: String,
        /// The key.
        key: String,
        /// The node whose life was still running.
        first: String,
        /// The node where the overlapping life started.
        second: String,
    },
    /// An `Ended` with no running life of that key on that node.
    EndWithoutStart {
        /// The module.
        module: String,
        /// The key.
        key: String,
        /// The node that reported it.
        node: String,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Overlap {
                module,
                key,
                first,
                second,
            } => write!(
                f,
                "two live processes of {module}/{key}: one started on {second} while the one on {first} was still alive"
            ),
            Violation::EndWithoutStart { module, key, node } => {
                write!(f, "{module}/{key} ended on {node} without having started")
            }
        }
    }
}

/// Check a record of key life events: no two lives of one `(module, key)`
/// may overlap, anywhere. Events are ordered by their instant; events with
/// equal instants keep their recording order (an `Ended` recorded before a
/// `Started` at the same instant happened before it).
///
/// # Errors
///
/// Every violation found (per key, in time order).
pub fn check(events: &[KeyLife]) -> Result<Summary, Vec<Violation>> {
    let mut by_key: BTreeMap<(&str, &str), Vec<&KeyLife>> = BTreeMap::new();
    for event in events {
        by_key
            .entry((event.module.as_str(), event.key.as_str()))
            .or_default()
            .push(event);
    }
    let mut violations = Vec::new();
    let mut lives = 0;
    for (&(module, key), events) in &mut by_key {
        // A stable sort: ties keep recording order.
        events.sort_by_key(|e| e.at);
        // The nodes with a running life of this key, one entry per life.
        let mut running: Vec<&str> = Vec::new();
        for &event in events.iter() {
            match event.event {
                KeyLifeEvent::Started => {
                    lives += 1;
                    if let Some(first) = running.first() {
                        violations.push(Violation::Overlap {
                            module: module.to_owned(),
                            key: key.to_owned(),
                            first: (*first).to_owned(),
                            second: event.node.clone(),
                        });
                    }
                    running.push(&event.node);
                }
                KeyLifeEvent::Ended => match running.iter().position(|n| *n == event.node) {
                    Some(i) => {
                        running.remove(i);
                    }
                    None => violations.push(Violation::EndWithoutStart {
                        module: module.to_owned(),
                        key: key.to_owned(),
                        node: event.node.clone(),
                    }),
                },
            }
        }
    }
    if violations.is_empty() {
        Ok(Summary {
            lives,
            keys: by_key.len(),
        })
    } else {
        Err(violations)
    }
}

/// Panic, listing every violation, unless `events` is clean.
pub fn assert_single_ownership(events: &[KeyLife]) -> Summary {
    match check(events) {
        Ok(summary) => summary,
        Err(violations) => {
            let list: Vec<String> = violations.iter().map(|v| format!("  - {v}")).collect();
            panic!(
                "single ownership violated ({} violation(s)):\n{}",
                violations.len(),
                list.join("\n")
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// A synthetic event `ms` milliseconds after `t0`.
    fn life(t0: Instant, ms: u64, node: &str, key: &str, event: KeyLifeEvent) -> KeyLife {
        KeyLife {
            node: node.to_owned(),
            module: "counter".to_owned(),
            key: key.to_owned(),
            event,
            at: t0 + Duration::from_millis(ms),
        }
    }

    use KeyLifeEvent::{Ended, Started};

    #[test]
    fn cluster_checker_accepts_lives_one_after_another() {
        let t0 = Instant::now();
        let events = [
            life(t0, 0, "n0", "alice", Started),
            life(t0, 10, "n0", "alice", Ended),
            life(t0, 20, "n1", "alice", Started),
            life(t0, 30, "n1", "alice", Ended),
            life(t0, 30, "n0", "alice", Started),
            // Other keys may overlap with alice and with each other.
            life(t0, 5, "n1", "bob", Started),
            life(t0, 6, "n2", "carol", Started),
        ];
        assert_eq!(check(&events), Ok(Summary { lives: 5, keys: 3 }));
        assert_eq!(assert_single_ownership(&events).lives, 5);
    }

    #[test]
    fn cluster_checker_orders_by_instant_not_by_recording_order() {
        let t0 = Instant::now();
        // Recorded out of order (two threads raced to the recorder's lock).
        let events = [
            life(t0, 20, "n1", "alice", Started),
            life(t0, 0, "n0", "alice", Started),
            life(t0, 10, "n0", "alice", Ended),
        ];
        assert!(check(&events).is_ok());
    }

    /// The checker bites: two overlapping lives on two nodes.
    #[test]
    fn cluster_checker_rejects_overlap_on_two_nodes() {
        let t0 = Instant::now();
        let events = [
            life(t0, 0, "n0", "alice", Started),
            life(t0, 10, "n1", "alice", Started),
            life(t0, 20, "n0", "alice", Ended),
            life(t0, 30, "n1", "alice", Ended),
        ];
        assert_eq!(
            check(&events),
            Err(vec![Violation::Overlap {
                module: "counter".to_owned(),
                key: "alice".to_owned(),
                first: "n0".to_owned(),
                second: "n1".to_owned(),
            }])
        );
        let panic = std::panic::catch_unwind(|| assert_single_ownership(&events))
            .expect_err("the checker must fail on overlapping lives");
        let message = panic
            .downcast_ref::<String>()
            .expect("a formatted panic message");
        assert!(
            message.contains("two live processes of counter/alice"),
            "{message}"
        );
    }

    /// The checker bites: two overlapping lives on one node, and a life that
    /// never ended overlapping a later one.
    #[test]
    fn cluster_checker_rejects_overlap_on_one_node_and_open_lives() {
        let t0 = Instant::now();
        let same_node = [
            life(t0, 0, "n0", "alice", Started),
            life(t0, 1, "n0", "alice", Started),
            life(t0, 2, "n0", "alice", Ended),
            life(t0, 3, "n0", "alice", Ended),
        ];
        assert!(matches!(
            check(&same_node).as_ref().map_err(Vec::as_slice),
            Err([Violation::Overlap { first, second, .. }]) if first == "n0" && second == "n0"
        ));
        let never_ended = [
            life(t0, 0, "n0", "alice", Started),
            life(t0, 5_000, "n1", "alice", Started),
            life(t0, 6_000, "n1", "alice", Ended),
        ];
        assert!(check(&never_ended).is_err());
    }

    #[test]
    #[should_panic(expected = "single ownership violated")]
    fn cluster_checker_panics_on_overlap() {
        let t0 = Instant::now();
        assert_single_ownership(&[
            life(t0, 0, "n2", "bob", Started),
            life(t0, 0, "n1", "bob", Started),
        ]);
    }

    #[test]
    fn cluster_checker_rejects_an_end_without_a_start() {
        let t0 = Instant::now();
        let events = [
            life(t0, 0, "n0", "alice", Started),
            life(t0, 1, "n1", "alice", Ended),
        ];
        assert!(matches!(
            check(&events).as_ref().map_err(Vec::as_slice),
            Err([Violation::EndWithoutStart { node, .. }]) if node == "n1"
        ));
    }
}
