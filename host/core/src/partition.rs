//! Keys to partitions: a stable hash every language can reproduce.
//!
//! A key (a UTF-8 string) maps to partition `fnv1a64(key bytes) % partitions`,
//! where `fnv1a64` is the 64-bit FNV-1a hash (offset basis
//! `0xcbf29ce484222325`, prime `0x100000001b3`). The function never changes
//! between versions: every node, every guest SDK and every client must agree
//! on it, and the test vectors below pin it.

use std::fmt;

/// Default number of partitions per namespace (contract §3).
pub const DEFAULT_PARTITIONS: u32 = 1024;

/// A partition's number, in `0..partitions`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PartitionId(pub u32);

impl fmt::Display for PartitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}", self.0)
    }
}

/// How many partitions a namespace has: fixed for its lifetime, at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionCount(u32);

impl PartitionCount {
    /// A partition count, refusing zero.
    ///
    /// # Errors
    ///
    /// Returns a message when `count` is zero.
    pub fn new(count: u32) -> Result<Self, String> {
        if count == 0 {
            return Err("partitions must be at least 1".to_owned());
        }
        Ok(PartitionCount(count))
    }

    /// The count.
    pub fn get(self) -> u32 {
        self.0
    }

    /// Every partition id, in order.
    pub fn iter(self) -> impl Iterator<Item = PartitionId> {
        (0..self.0).map(PartitionId)
    }

    /// The partition `key` belongs to.
    ///
    /// ```
    /// use fief_core::{PartitionCount, PartitionId};
    ///
    /// let partitions = PartitionCount::default();
    /// assert_eq!(partitions.of("alice"), PartitionId(263));
    /// ```
    pub fn of(self, key: &str) -> PartitionId {
        PartitionId((fnv1a64(key.as_bytes()) % u64::from(self.0)) as u32)
    }
}

impl Default for PartitionCount {
    fn default() -> Self {
        PartitionCount(DEFAULT_PARTITIONS)
    }
}

/// 64-bit FNV-1a.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET_BASIS, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectors every implementation must reproduce (docs/design.md).
    #[test]
    fn test_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        let p = PartitionCount::default();
        let vectors = [
            ("alice", 263),
            ("bob", 596),
            ("", 805),
            ("user:42", 450),
            ("🦀", 742),
        ];
        for (key, partition) in vectors {
            assert_eq!(p.of(key), PartitionId(partition), "key {key:?}");
        }
    }

    #[test]
    fn zero_partitions_is_refused() {
        assert!(PartitionCount::new(0).is_err());
    }
}
