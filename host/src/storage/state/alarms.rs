//! A key's durable alarms in its process: `set-alarm`, `cancel-alarm` and
//! `list-alarms` on the loaded state, and the start of a firing's callback.
//!
//! Alarms are rows of the key's state (`docs/alarms.md`): loaded with it,
//! changed by writes of the callback's commit ([`Write::SetAlarm`],
//! [`Write::CancelAlarm`]), counted against the callback's writes and the
//! module's `max_alarms_per_key`. This file owns that bookkeeping; it never
//! reads a clock (the caller passes `now_ms`) and talks to no backend.

use fief_core::alarm::check_set;

use super::KeyState;
use crate::bindings::storage::StorageError;
use crate::storage::Write;

/// Host memory charged per alarm beyond its name (its time and map node).
pub(crate) const ALARM_OVERHEAD: u64 = 64;

impl KeyState {
    /// Set alarm `name` to `at_ms` (replacing one of that name); `now_ms`
    /// is the node's wall clock, for the ten-year bound.
    pub(crate) fn set_alarm(
        &mut self,
        name: String,
        at_ms: u64,
        now_ms: u64,
    ) -> Result<(), StorageError> {
        check_set(&name, at_ms, now_ms).map_err(|e| StorageError::Invalid(e.to_string()))?;
        if !self.alarms.contains_key(&name) && self.alarms.len() >= self.limits.max_alarms as usize
        {
            return Err(StorageError::Limit(format!(
                "this key already has {} alarms (max_alarms_per_key); cancel one first",
                self.alarms.len()
            )));
        }
        self.count_write()?;
        self.alarms.insert(name.clone(), at_ms);
        self.alarm_writes.push(Write::SetAlarm { name, at_ms });
        Ok(())
    }

    /// Cancel alarm `name`; whether it was set.
    pub(crate) fn cancel_alarm(&mut self, name: &str) -> Result<bool, StorageError> {
        if self.alarms.contains_key(name) {
            self.count_write()?;
            self.alarms.remove(name);
            self.alarm_writes.push(Write::CancelAlarm {
                name: name.to_owned(),
            });
            return Ok(true);
        }
        Ok(false)
    }

    /// Every alarm, `(name, at_ms)`, sorted by name.
    pub(crate) fn list_alarms(&self) -> Vec<(String, u64)> {
        self.alarms.iter().map(|(n, at)| (n.clone(), *at)).collect()
    }

    /// A firing of alarm `name`, due at `at_ms`, is about to run its
    /// handler: if the key still holds that alarm at that time, delete it as
    /// this callback's first write and say so; otherwise the key's own view
    /// wins (`Err` with its time for the alarm, if it has one) and the
    /// handler must not run.
    pub(crate) fn begin_firing(&mut self, name: &str, at_ms: u64) -> Result<(), Option<u64>> {
        match self.alarms.get(name) {
            Some(at) if *at == at_ms => {
                self.alarms.remove(name);
                self.alarm_writes.insert(
                    0,
                    Write::CancelAlarm {
                        name: name.to_owned(),
                    },
                );
                Ok(())
            }
            other => Err(other.copied()),
        }
    }

    /// Host memory the alarms make the node hold.
    pub(super) fn alarm_bytes(&self) -> u64 {
        self.alarms
            .keys()
            .map(|n| n.len() as u64 + ALARM_OVERHEAD)
            .sum()
    }
}
