//! The per-node schedule of durable alarms: which stored alarm fires now,
//! on which key, with which attempt number, and when to look again.
//!
//! A node holds one [`AlarmSchedule`] for the partitions it serves
//! (`docs/alarms.md`). It is fed five kinds of input: a partition became
//! served under a token with its stored alarms ([`AlarmSchedule::serve`]), a
//! partition stopped being served ([`AlarmSchedule::stop`]), a key's commit
//! landed with alarm changes ([`AlarmSchedule::committed`]), the wall clock
//! moved ([`AlarmSchedule::due`], which returns the [`Firing`]s to deliver),
//! and a firing's outcome ([`AlarmSchedule::finished`]). Its rules, each
//! with a test in `tests.rs`:
//!
//! - never fire before the alarm's `at` (nor before its retry time);
//! - never fire for a partition that is not served, and never under
//!   another token than the one it is served under;
//! - at most one firing in flight per alarm;
//! - a trapped handler (or a commit that did not land) is retried with
//!   capped exponential backoff and `attempt + 1`;
//! - an alarm set again while it fires is not deleted by that firing's
//!   completion (a version tells them apart);
//! - outcomes and commits under a stale token, or for a firing that is not
//!   the one in flight, change nothing.
//!
//! It must not do I/O or read a clock: `now` is the firing node's wall clock
//! in milliseconds since the Unix epoch, passed in. It iterates only ordered
//! maps, so its decisions depend on its inputs alone. It knows nothing of
//! stores, processes or guests: the node (or a test) carries its outputs out.

use std::collections::{BTreeMap, BTreeSet};

#[cfg(test)]
mod tests;

/// Longest alarm name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// How far ahead of `now` an alarm may be set: ten years, in milliseconds.
pub const MAX_AHEAD_MS: u64 = 10 * 366 * 24 * 3600 * 1000;

/// Why a `set-alarm` is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InvalidAlarm {
    /// The name is empty or longer than [`MAX_NAME_BYTES`].
    Name {
        /// Its length in bytes.
        bytes: usize,
    },
    /// `at` is more than [`MAX_AHEAD_MS`] after `now`.
    TooFar {
        /// The time asked for.
        at_ms: u64,
        /// The latest time allowed now.
        latest_ms: u64,
    },
}

impl std::fmt::Display for InvalidAlarm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InvalidAlarm::Name { bytes } => write!(
                f,
                "an alarm's name is 1 to {MAX_NAME_BYTES} bytes; this one has {bytes}"
            ),
            InvalidAlarm::TooFar { at_ms, latest_ms } => write!(
                f,
                "an alarm at {at_ms} ms is more than ten years ahead; the latest allowed now is \
                 {latest_ms} ms (milliseconds since the Unix epoch)"
            ),
        }
    }
}

/// Whether a key may set alarm `name` at `at_ms` when its node's clock reads
/// `now_ms`. An `at` in the past is allowed: the alarm fires as soon as it
/// can.
///
/// # Errors
///
/// [`InvalidAlarm`] naming the rule broken.
pub fn check_set(name: &str, at_ms: u64, now_ms: u64) -> Result<(), InvalidAlarm> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(InvalidAlarm::Name { bytes: name.len() });
    }
    let latest_ms = now_ms.saturating_add(MAX_AHEAD_MS);
    if at_ms > latest_ms {
        return Err(InvalidAlarm::TooFar { at_ms, latest_ms });
    }
    Ok(())
}

/// One alarm: whose, which, and where. Ordered by partition first, so a
/// partition's alarms are one range.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AlarmId {
    /// The key's partition.
    pub partition: u32,
    /// The module's stored name (it carries the tenant).
    pub module: String,
    /// The key.
    pub key: String,
    /// The alarm's name, unique per key.
    pub name: String,
}

/// An alarm as stored: which, and when, in milliseconds since the Unix
/// epoch. What a partition's load gives [`AlarmSchedule::serve`].
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StoredAlarm {
    /// Which alarm.
    pub id: AlarmId,
    /// When it is due.
    pub at_ms: u64,
}

/// A change a landed commit made to one of its key's alarms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AlarmChange {
    /// Set (or move) alarm `name` to `at_ms`.
    Set {
        /// The alarm's name.
        name: String,
        /// When it is due.
        at_ms: u64,
    },
    /// Cancel alarm `name` (no-op if there is none).
    Cancel {
        /// The alarm's name.
        name: String,
    },
}

/// Names one firing, so that its outcome can be matched to it (and a late
/// outcome of an older firing ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FiringId(pub u64);

/// An alarm to deliver now: `handle-info(alarm(name, attempt))` on the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Firing {
    /// This firing, for [`AlarmSchedule::finished`].
    pub id: FiringId,
    /// The alarm.
    pub alarm: AlarmId,
    /// The ownership token the partition is served under: the key's process
    /// must run under it.
    pub token: u64,
    /// The alarm's time, as the schedule knows it (the key checks it against
    /// its own loaded alarms before running the handler).
    pub at_ms: u64,
    /// 1 for the first run of the handler on this node, then one more per
    /// run that trapped or did not commit.
    pub attempt: u32,
}

/// What became of a firing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FireOutcome {
    /// The handler ran and its callback's commit (which deletes the alarm,
    /// unless the handler set it again) landed.
    Committed,
    /// The handler trapped: nothing was committed. Retried.
    Trapped,
    /// The handler ran but its commit did not land (stale token, store
    /// failed or timed out). Retried; if the token is stale, the partition
    /// is about to stop being served here and its next owner fires it.
    CommitRefused,
    /// The handler did not run (the key could not be activated, its mailbox
    /// was full, it was killed). Retried after the same backoff, with the
    /// same attempt number.
    NotRun,
    /// The handler did not run because the key's own loaded alarms disagree
    /// with the firing (a cancel or re-set the schedule had not seen): the
    /// key's view wins. `at_ms`: its alarm's time, `None` if it has none.
    Superseded {
        /// The key's own time for the alarm, if it has one.
        at_ms: Option<u64>,
    },
}

/// Capped exponential backoff between retries of a failing handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Delay after the first failed attempt, in milliseconds.
    pub first_ms: u64,
    /// The most any delay grows to, in milliseconds.
    pub max_ms: u64,
}

impl Default for RetryPolicy {
    /// 1 s, doubling, capped at 5 minutes.
    fn default() -> Self {
        RetryPolicy {
            first_ms: 1_000,
            max_ms: 300_000,
        }
    }
}

impl RetryPolicy {
    /// The delay after attempt `attempt` (1-based) failed:
    /// `first · 2^(attempt − 1)`, capped at `max`.
    pub fn delay_ms(&self, attempt: u32) -> u64 {
        let doublings = attempt.saturating_sub(1).min(63);
        self.first_ms
            .saturating_mul(1u64 << doublings)
            .min(self.max_ms)
    }
}

/// One alarm of a served partition, as the schedule keeps it.
#[derive(Clone, Debug)]
struct Entry {
    /// When it is due; `None`: cancelled while a firing was in flight (kept
    /// until that firing's outcome, so a second firing cannot start).
    at_ms: Option<u64>,
    /// Bumped at every change, so a firing's completion can tell whether
    /// the alarm it fired is still the stored one.
    version: u64,
    /// Handler runs that failed since the alarm was last set.
    failed: u32,
    /// Not before this time (a retry's backoff), if set.
    retry_at_ms: Option<u64>,
    /// The firing in flight and the version it fired.
    in_flight: Option<(FiringId, u64)>,
}

impl Entry {
    /// When it may fire next, if it is waiting (not in flight, not
    /// cancelled).
    fn due_ms(&self) -> Option<u64> {
        if self.in_flight.is_some() {
            return None;
        }
        let at = self.at_ms?;
        Some(self.retry_at_ms.map_or(at, |r| r.max(at)))
    }
}

/// The alarms of the partitions one node serves, and what to fire (see the
/// module header).
#[derive(Clone, Debug, Default)]
pub struct AlarmSchedule {
    policy: RetryPolicy,
    /// Served partitions and their tokens.
    served: BTreeMap<u32, u64>,
    /// Every alarm of the served partitions.
    alarms: BTreeMap<AlarmId, Entry>,
    /// The waiting alarms by due time: exactly those whose `due_ms()` is
    /// `Some`, with that time.
    queue: BTreeSet<(u64, AlarmId)>,
    next_version: u64,
    next_firing: u64,
}

impl AlarmSchedule {
    /// An empty schedule retrying by `policy`.
    pub fn new(policy: RetryPolicy) -> Self {
        AlarmSchedule {
            policy,
            ..AlarmSchedule::default()
        }
    }

    /// The partition is served under `token`, and `alarms` are its stored
    /// alarms as loaded under that token (the load raised the partition's
    /// fence to it). Replaces whatever the schedule held for the partition
    /// under an older token. A token not above the one it is already served
    /// under is a late or repeated answer and is ignored (a reload would
    /// forget the firings in flight); alarms of another partition in
    /// `alarms` are ignored.
    pub fn serve(
        &mut self,
        partition: u32,
        token: u64,
        alarms: impl IntoIterator<Item = StoredAlarm>,
    ) {
        if self.served.get(&partition).is_some_and(|t| *t >= token) {
            return;
        }
        self.stop(partition);
        self.served.insert(partition, token);
        for alarm in alarms {
            if alarm.id.partition == partition {
                self.set(alarm.id, alarm.at_ms);
            }
        }
    }

    /// The partition is no longer served here (moved, reaped, fenced): none
    /// of its alarms fires, and outcomes of its firings are ignored.
    pub fn stop(&mut self, partition: u32) {
        if self.served.remove(&partition).is_none() {
            return;
        }
        let first = AlarmId {
            partition,
            module: String::new(),
            key: String::new(),
            name: String::new(),
        };
        let mut dropped = self.alarms.split_off(&first);
        if let Some(next) = partition.checked_add(1) {
            let mut kept = dropped.split_off(&AlarmId {
                partition: next,
                ..first
            });
            self.alarms.append(&mut kept);
        }
        for (id, entry) in dropped {
            if let Some(due) = entry.due_ms() {
                self.queue.remove(&(due, id));
            }
        }
    }

    /// A commit of `module`/`key` landed under `token` on `partition`, with
    /// these alarm changes in the order it made them. Ignored unless the
    /// partition is served under that token (a commit under an older token
    /// landed before the load the partition is served from, which saw it).
    pub fn committed(
        &mut self,
        partition: u32,
        token: u64,
        module: &str,
        key: &str,
        changes: &[AlarmChange],
    ) {
        if self.served.get(&partition) != Some(&token) {
            return;
        }
        let id = |name: &str| AlarmId {
            partition,
            module: module.to_owned(),
            key: key.to_owned(),
            name: name.to_owned(),
        };
        for change in changes {
            match change {
                AlarmChange::Set { name, at_ms } => self.set(id(name), *at_ms),
                AlarmChange::Cancel { name } => self.cancel(id(name)),
            }
        }
    }

    /// Every alarm due at `now_ms`, earliest first, at most `max` of them,
    /// each now in flight until its [`finished`](Self::finished).
    pub fn due(&mut self, now_ms: u64, max: usize) -> Vec<Firing> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some((due, _)) = self.queue.first() else {
                break;
            };
            if *due > now_ms {
                break;
            }
            let Some((_, id)) = self.queue.pop_first() else {
                break;
            };
            let token = self.served.get(&id.partition).copied();
            let Some(entry) = self.alarms.get_mut(&id) else {
                continue;
            };
            let (Some(token), Some(at_ms)) = (token, entry.at_ms) else {
                continue;
            };
            // The rules that must never break, checked always: a firing
            // before its time or of an unserved partition is a bug.
            assert!(at_ms <= now_ms, "alarm {id:?} fired before its time");
            assert!(entry.in_flight.is_none(), "alarm {id:?} fired twice");
            let fid = FiringId(self.next_firing);
            self.next_firing += 1;
            entry.in_flight = Some((fid, entry.version));
            out.push(Firing {
                id: fid,
                alarm: id,
                token,
                at_ms,
                attempt: entry.failed.saturating_add(1),
            });
        }
        out
    }

    /// What became of `firing` at `now_ms`. Ignored unless it is the
    /// firing in flight for its alarm, under the token its partition is
    /// served under.
    pub fn finished(&mut self, firing: &Firing, outcome: FireOutcome, now_ms: u64) {
        let id = &firing.alarm;
        if self.served.get(&id.partition) != Some(&firing.token) {
            return;
        }
        let Some(entry) = self.alarms.get_mut(id) else {
            return;
        };
        let Some((fid, fired_version)) = entry.in_flight else {
            return;
        };
        if fid != firing.id {
            return;
        }
        entry.in_flight = None;
        let unchanged = entry.version == fired_version;
        match outcome {
            // The commit deleted the alarm it fired; a newer one stays.
            FireOutcome::Committed if unchanged => {
                self.alarms.remove(id);
                return;
            }
            FireOutcome::Trapped | FireOutcome::CommitRefused if unchanged => {
                entry.failed = firing.attempt;
                entry.retry_at_ms = Some(now_ms.saturating_add(self.policy.delay_ms(entry.failed)));
            }
            FireOutcome::NotRun if unchanged => {
                entry.retry_at_ms =
                    Some(now_ms.saturating_add(self.policy.delay_ms(firing.attempt)));
            }
            FireOutcome::Superseded { at_ms } => {
                match at_ms {
                    Some(at) if unchanged => self.set(id.clone(), at),
                    None if unchanged => self.cancel(id.clone()),
                    // Changed since: the schedule has heard of the newer
                    // state itself, which wins over the key's older view.
                    _ => {}
                }
            }
            // Changed (set again or cancelled) while in flight: the newer
            // state stands as it is.
            _ => {}
        }
        self.settle(id);
    }

    /// When [`due`](Self::due) has something to fire next (`None`:
    /// nothing waits; in-flight alarms wake it through `finished`).
    pub fn next_wake(&self) -> Option<u64> {
        self.queue.first().map(|(due, _)| *due)
    }

    /// The alarms held (waiting, retrying or in flight).
    pub fn len(&self) -> usize {
        self.alarms.len()
    }

    /// Whether it holds no alarm.
    pub fn is_empty(&self) -> bool {
        self.alarms.is_empty()
    }

    /// The firings in flight.
    pub fn in_flight(&self) -> usize {
        self.alarms
            .values()
            .filter(|e| e.in_flight.is_some())
            .count()
    }

    /// The served partitions and their tokens.
    pub fn served(&self) -> &BTreeMap<u32, u64> {
        &self.served
    }

    /// Set or move an alarm: a new version, retries forgotten.
    fn set(&mut self, id: AlarmId, at_ms: u64) {
        self.unqueue(&id);
        let version = self.bump();
        let entry = self.alarms.entry(id.clone()).or_insert(Entry {
            at_ms: None,
            version,
            failed: 0,
            retry_at_ms: None,
            in_flight: None,
        });
        entry.at_ms = Some(at_ms);
        entry.version = version;
        entry.failed = 0;
        entry.retry_at_ms = None;
        self.settle(&id);
    }

    /// Cancel an alarm: gone, or a tombstone while a firing is in flight.
    fn cancel(&mut self, id: AlarmId) {
        self.unqueue(&id);
        let version = self.bump();
        if let Some(entry) = self.alarms.get_mut(&id) {
            entry.at_ms = None;
            entry.version = version;
        }
        self.settle(&id);
    }

    /// Remove `id` from the queue if it waits there.
    fn unqueue(&mut self, id: &AlarmId) {
        if let Some(due) = self.alarms.get(id).and_then(Entry::due_ms) {
            self.queue.remove(&(due, id.clone()));
        }
    }

    /// After a change to `id`'s entry (taken off the queue before): drop a
    /// tombstone no firing waits on, or queue it at its due time.
    fn settle(&mut self, id: &AlarmId) {
        let Some(entry) = self.alarms.get(id) else {
            return;
        };
        if entry.at_ms.is_none() && entry.in_flight.is_none() {
            self.alarms.remove(id);
        } else if let Some(due) = entry.due_ms() {
            self.queue.insert((due, id.clone()));
        }
    }

    fn bump(&mut self) -> u64 {
        self.next_version += 1;
        self.next_version
    }
}
