//! One key process's durable state in memory: its whole state as loaded,
//! the names its current callbacks changed since the last commit, and the
//! limits every write is checked against.
//!
//! The process loads its key's state once, before its first callback, and
//! serves every read after that from here. A write changes the map at once
//! (reads in the same callback see it) and marks its name dirty; the commit
//! at the end of the callback is made from the dirty names and the map
//! ([`KeyState::take_commit`]), so a name overwritten a thousand times is
//! sent once and no value is copied before the commit. A range delete is
//! expanded into the names it removes: the process holds every name.
//!
//! This file owns that bookkeeping and the limits. It must not talk to a
//! backend or know about callbacks' outputs (`writer.rs` and the output
//! gate do); it never blocks.

mod alarms;

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use super::{Loaded, Write};
use crate::bindings::storage::StorageError;

/// Longest name of a stored entry, in bytes.
pub const MAX_NAME_BYTES: usize = 2048;

/// Bytes the node is taken to hold per entry beyond its name and value
/// (the map's node and the two buffers' headers), for host-memory charging.
pub(crate) const ENTRY_OVERHEAD: u64 = 64;

/// What one key's writes are checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StorageLimits {
    /// Largest value (the module's `max_storage_value_size`).
    pub(crate) max_value: u64,
    /// Most bytes (names plus values) one key may store
    /// (`max_storage_bytes_per_key`).
    pub(crate) max_bytes_per_key: u64,
    /// Most bytes a tenant may store, every key of every module together
    /// (the node's `max_storage_bytes_per_tenant`).
    pub(crate) max_bytes_per_tenant: u64,
    /// Most writes (puts, deletes, range deletes) in one callback
    /// (`max_storage_writes_per_callback`).
    pub(crate) max_writes_per_callback: u32,
    /// Most alarms one key may hold (`max_alarms_per_key`).
    pub(crate) max_alarms: u32,
}

/// A key's state in its process.
#[derive(Debug)]
pub(crate) struct KeyState {
    entries: BTreeMap<String, Vec<u8>>,
    /// Names plus values of `entries`.
    bytes: u64,
    /// `bytes` as of the last commit (or the load).
    committed_bytes: u64,
    /// Names changed since the last commit.
    dirty: BTreeSet<String>,
    /// Bytes of the names in `dirty`.
    dirty_bytes: u64,
    /// Writes in the current callback.
    writes: u32,
    limits: StorageLimits,
    /// The key's alarms, `name → at_ms`, as of its writes so far.
    alarms: BTreeMap<String, u64>,
    /// Alarm writes since the last commit, in the order they were made.
    alarm_writes: Vec<Write>,
}

fn size(name: &str, value: &[u8]) -> u64 {
    (name.len() + value.len()) as u64
}

impl KeyState {
    /// The state as `loaded` from the store.
    pub(crate) fn new(loaded: Loaded, limits: StorageLimits) -> Self {
        let bytes = loaded.entries.iter().map(|(n, v)| size(n, v)).sum();
        KeyState {
            entries: loaded.entries.into_iter().collect(),
            bytes,
            committed_bytes: bytes,
            dirty: BTreeSet::new(),
            dirty_bytes: 0,
            writes: 0,
            limits,
            alarms: loaded.alarms.into_iter().collect(),
            alarm_writes: Vec::new(),
        }
    }

    /// Host memory this state makes the node hold (entries and dirty names).
    pub(crate) fn held_bytes(&self) -> u64 {
        self.bytes
            + ENTRY_OVERHEAD * self.entries.len() as u64
            + self.dirty_bytes
            + self.alarm_bytes()
    }

    /// Whether writes wait for a commit.
    pub(crate) fn has_pending(&self) -> bool {
        !self.dirty.is_empty() || !self.alarm_writes.is_empty()
    }

    /// A new callback begins: its writes are counted from zero.
    pub(crate) fn begin_callback(&mut self) {
        self.writes = 0;
    }

    /// The value of `name`.
    pub(crate) fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StorageError> {
        check_name(name)?;
        Ok(self.entries.get(name).cloned())
    }

    /// Set `name` to `value`; `tenant_bytes` is what the tenant stores
    /// now, as the node last learnt it.
    pub(crate) fn put(
        &mut self,
        name: String,
        value: Vec<u8>,
        tenant_bytes: u64,
    ) -> Result<(), StorageError> {
        check_name(&name)?;
        if value.len() as u64 > self.limits.max_value {
            return Err(StorageError::Invalid(format!(
                "a value of {} bytes is over max_storage_value_size ({} bytes)",
                value.len(),
                self.limits.max_value
            )));
        }
        let old = self.entries.get(&name).map_or(0, |v| size(&name, v));
        let new = size(&name, &value);
        let after = self.bytes - old + new;
        if new > old {
            if after > self.limits.max_bytes_per_key {
                return Err(StorageError::Limit(format!(
                    "this key would store {after} bytes, over max_storage_bytes_per_key ({} \
                     bytes); delete entries first",
                    self.limits.max_bytes_per_key
                )));
            }
            // `tenant_bytes` counts this key as last committed.
            let tenant_after =
                tenant_bytes.saturating_add(after.saturating_sub(self.committed_bytes));
            if tenant_after > self.limits.max_bytes_per_tenant {
                return Err(StorageError::Limit(format!(
                    "this key's tenant would store about {tenant_after} bytes, over \
                     max_storage_bytes_per_tenant ({} bytes); delete entries first",
                    self.limits.max_bytes_per_tenant
                )));
            }
        }
        self.count_write()?;
        self.bytes = after;
        self.mark(&name);
        self.entries.insert(name, value);
        Ok(())
    }

    /// Remove `name`; whether it was there.
    pub(crate) fn delete(&mut self, name: &str) -> Result<bool, StorageError> {
        check_name(name)?;
        self.count_write()?;
        let Some(old) = self.entries.remove(name) else {
            return Ok(false);
        };
        self.bytes -= size(name, &old);
        self.mark(name);
        Ok(true)
    }

    /// Up to `limit` entries in `start..end`, sorted.
    pub(crate) fn list(
        &self,
        start: &str,
        end: Option<&str>,
        limit: u32,
    ) -> Result<Vec<(String, Vec<u8>)>, StorageError> {
        let range = range(start, end)?;
        Ok(self
            .entries
            .range::<str, _>(range)
            .take(limit as usize)
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect())
    }

    /// Remove every entry in `start..end`; how many.
    pub(crate) fn delete_range(
        &mut self,
        start: &str,
        end: Option<&str>,
    ) -> Result<u64, StorageError> {
        let range = range(start, end)?;
        self.count_write()?;
        let names: Vec<String> = self
            .entries
            .range::<str, _>(range)
            .map(|(n, _)| n.clone())
            .collect();
        for name in &names {
            if let Some(old) = self.entries.remove(name) {
                self.bytes -= size(name, &old);
            }
            self.mark(name);
        }
        Ok(names.len() as u64)
    }

    /// The writes to commit since the last commit, and how many bytes the
    /// key's state grew by; `None` when nothing changed. The state counts
    /// them as committed: if the commit fails, the process must end (its
    /// memory is then ahead of the store).
    pub(crate) fn take_commit(&mut self) -> Option<(Vec<Write>, i64)> {
        if !self.has_pending() {
            return None;
        }
        // Alarm writes first, in the order they were made (a firing's
        // delete of its alarm is the first of them), then the entries.
        let mut writes = std::mem::take(&mut self.alarm_writes);
        writes.extend(std::mem::take(&mut self.dirty).into_iter().map(|name| {
            match self.entries.get(&name) {
                Some(value) => Write::Put {
                    value: value.clone(),
                    name,
                },
                None => Write::Delete { name },
            }
        }));
        self.dirty_bytes = 0;
        let delta = self.bytes as i64 - self.committed_bytes as i64;
        self.committed_bytes = self.bytes;
        Some((writes, delta))
    }

    fn mark(&mut self, name: &str) {
        if !self.dirty.contains(name) {
            self.dirty_bytes += name.len() as u64;
            self.dirty.insert(name.to_owned());
        }
    }

    fn count_write(&mut self) -> Result<(), StorageError> {
        if self.writes >= self.limits.max_writes_per_callback {
            return Err(StorageError::Limit(format!(
                "this callback already made {} writes (max_storage_writes_per_callback)",
                self.writes
            )));
        }
        self.writes += 1;
        Ok(())
    }
}

fn check_name(name: &str) -> Result<(), StorageError> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(StorageError::Invalid(format!(
            "a stored entry's name is 1 to {MAX_NAME_BYTES} bytes long, not {}",
            name.len()
        )));
    }
    Ok(())
}

/// The names `start..end` (to the last without an `end`).
fn range<'a>(
    start: &'a str,
    end: Option<&'a str>,
) -> Result<(Bound<&'a str>, Bound<&'a str>), StorageError> {
    if start.len() > MAX_NAME_BYTES || end.is_some_and(|end| end.len() > MAX_NAME_BYTES) {
        return Err(StorageError::Invalid(format!(
            "a range's bounds are at most {MAX_NAME_BYTES} bytes long"
        )));
    }
    match end {
        Some(end) if end < start => Err(StorageError::Invalid(format!(
            "the range's end {end:?} is before its start {start:?}"
        ))),
        Some(end) => Ok((Bound::Included(start), Bound::Excluded(end))),
        None => Ok((Bound::Included(start), Bound::Unbounded)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: StorageLimits = StorageLimits {
        max_alarms: 16,
        max_value: 100,
        max_bytes_per_key: 1000,
        max_bytes_per_tenant: 5000,
        max_writes_per_callback: 10,
    };

    fn state(entries: &[(&str, &str)]) -> KeyState {
        let entries = entries
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
            .collect();
        KeyState::new(
            Loaded {
                entries,
                ..Loaded::default()
            },
            LIMITS,
        )
    }

    fn put(name: &str, value: &str) -> Write {
        Write::Put {
            name: name.to_owned(),
            value: value.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_name_written_many_times_is_committed_once_with_its_last_value() {
        let mut s = state(&[("a", "1")]);
        for v in ["2", "3", "4"] {
            s.put("a".into(), v.into(), 0).unwrap();
        }
        s.put("b".into(), "x".into(), 0).unwrap();
        assert!(s.delete("b").unwrap());
        let (writes, delta) = s.take_commit().unwrap();
        assert_eq!(
            writes,
            vec![
                put("a", "4"),
                Write::Delete {
                    name: "b".to_owned()
                }
            ]
        );
        assert_eq!(delta, 0);
        assert!(s.take_commit().is_none(), "nothing left after a commit");
        assert_eq!(s.get("a").unwrap().as_deref(), Some(&b"4"[..]));
    }

    #[test]
    fn a_range_delete_removes_exactly_its_range() {
        let mut s = state(&[("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")]);
        assert_eq!(s.delete_range("b", Some("d")).unwrap(), 2);
        let names: Vec<_> = s
            .list("", None, 10)
            .unwrap()
            .into_iter()
            .map(|e| e.0)
            .collect();
        assert_eq!(names, ["a", "d"]);
        assert_eq!(s.delete_range("c", None).unwrap(), 1);
        assert_eq!(s.bytes, 2);
        let (_, delta) = s.take_commit().unwrap();
        assert_eq!(delta, -6);
        assert!(matches!(
            s.delete_range("z", Some("a")),
            Err(StorageError::Invalid(_))
        ));
    }

    #[test]
    fn list_is_sorted_by_bytes_and_bounded() {
        let s = state(&[("b", ""), ("B", ""), ("é", ""), ("a", ""), ("aa", "")]);
        let names: Vec<_> = s
            .list("", None, 10)
            .unwrap()
            .into_iter()
            .map(|e| e.0)
            .collect();
        assert_eq!(names, ["B", "a", "aa", "b", "é"]);
        let names: Vec<_> = s
            .list("a", Some("b"), 1)
            .unwrap()
            .into_iter()
            .map(|e| e.0)
            .collect();
        assert_eq!(names, ["a"]);
    }

    #[test]
    fn every_limit_is_refused_with_its_name_and_nothing_changes() {
        let mut s = state(&[]);
        let err = s.put("x".into(), vec![0; 101], 0).unwrap_err();
        assert!(matches!(&err, StorageError::Invalid(m) if m.contains("max_storage_value_size")));
        let err = s.put(String::new(), vec![], 0).unwrap_err();
        assert!(matches!(err, StorageError::Invalid(_)));
        let err = s
            .put("n".repeat(MAX_NAME_BYTES + 1), vec![], 0)
            .unwrap_err();
        assert!(matches!(err, StorageError::Invalid(_)));
        for i in 0..9 {
            s.put(format!("k{i}"), vec![0; 99], 0).unwrap();
        }
        // 9 × 101 bytes stored; one more would pass 1000.
        let err = s.put("k9".into(), vec![0; 99], 0).unwrap_err();
        assert!(
            matches!(&err, StorageError::Limit(m) if m.contains("max_storage_bytes_per_key")),
            "{err:?}"
        );
        // The tenant stores 4900 elsewhere: 101 more would pass 5000.
        let mut t = state(&[]);
        t.put("k".into(), vec![0; 99], 4900).unwrap();
        t.delete("k").unwrap();
        let err = t.put("k".into(), vec![0; 100], 4900).unwrap_err();
        assert!(
            matches!(&err, StorageError::Limit(m) if m.contains("max_storage_bytes_per_tenant"))
        );
        // Shrinking is always allowed, over a limit or not.
        s.put("k0".into(), vec![], 4900 * 10).unwrap();
        assert_eq!(s.bytes, 8 * 101 + 2);
    }

    #[test]
    fn a_callback_makes_at_most_its_writes_and_the_next_starts_afresh() {
        let mut s = state(&[]);
        for i in 0..10 {
            s.put(format!("k{i}"), vec![], 0).unwrap();
        }
        let err = s.delete("k0").unwrap_err();
        assert!(
            matches!(&err, StorageError::Limit(m) if m.contains("max_storage_writes_per_callback"))
        );
        s.begin_callback();
        assert!(s.delete("k0").unwrap());
    }

    #[test]
    fn held_bytes_count_entries_and_dirty_names() {
        let mut s = state(&[("ab", "cd")]);
        assert_eq!(s.held_bytes(), 4 + ENTRY_OVERHEAD);
        s.put("xyz".into(), vec![1], 0).unwrap();
        assert_eq!(s.held_bytes(), 8 + 2 * ENTRY_OVERHEAD + 3);
        s.take_commit();
        assert_eq!(s.held_bytes(), 8 + 2 * ENTRY_OVERHEAD);
    }
}
