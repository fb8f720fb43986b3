//! The checker's record of key processes, kept from what happened (a
//! process started, ended, went to limbo; a node crashed) — never from the
//! executor's own bookkeeping (its key table, its limbo), which is what it
//! judges.
//!
//! - **One process of a key per node**: a process of a key starts on a node
//!   only once every earlier process of the key there has ended (an idle
//!   one's `terminate(idle)` included); one that survives a fence in limbo
//!   is a *survivor* (rule `BesideSurvivor`), any other a second live
//!   process (rule `TwoLiveProcesses`).

use std::collections::HashMap;

use super::checker::Rule;
use crate::ownership::NodeId;

/// A process that has not ended.
#[derive(Debug)]
struct Running {
    node: NodeId,
    key: String,
    in_limbo: bool,
}

/// A breach found: the rule and what happened.
pub(super) type Breach = (Rule, String);

/// Key processes, as they happened.
#[derive(Debug, Default)]
pub(super) struct Lives {
    running: HashMap<u64, Running>,
}

impl Lives {
    /// Process `life` of `key` started on `node`: no earlier process of
    /// the key may still run there.
    pub(super) fn started(&mut self, node: &NodeId, key: &str, life: u64) -> Vec<Breach> {
        let mut earlier: Vec<(u64, bool)> = self
            .running
            .iter()
            .filter(|(_, r)| &r.node == node && r.key == key)
            .map(|(id, r)| (*id, r.in_limbo))
            .collect();
        earlier.sort_unstable();
        let breaches = earlier
            .into_iter()
            .map(|(id, in_limbo)| if in_limbo {
                (
                    Rule::BesideSurvivor,
                    format!("{key} started on {node} beside a survivor of it in the same node's limbo (process {id})"),
                )
            } else {
                (
                    Rule::TwoLiveProcesses,
                    format!("{key} started on {node} (process {life}) while its process {id} there had not ended"),
                )
            })
            .collect();
        let running = Running {
            node: node.clone(),
            key: key.to_owned(),
            in_limbo: false,
        };
        self.running.insert(life, running);
        breaches
    }

    /// Process `life` ended (its entry may have gone before: that is what
    /// the one-process-per-node rule judges).
    pub(super) fn ended(&mut self, life: u64) {
        self.running.remove(&life);
    }

    /// Process `life` survived a fence: it lives on in its node's limbo.
    pub(super) fn survived(&mut self, life: u64) {
        if let Some(r) = self.running.get_mut(&life) {
            r.in_limbo = true;
        }
    }

    /// `node` crashed: its processes are gone.
    pub(super) fn crashed(&mut self, node: &NodeId) {
        self.running.retain(|_, r| &r.node != node);
    }
}
