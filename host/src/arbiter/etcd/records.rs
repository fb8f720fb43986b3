//! What the etcd arbiter keeps in etcd: the key layout of a namespace and
//! the JSON records stored there (a member, the leader, the table), each
//! carrying a format number so a later Fief can change them.
//!
//! The layout, under the URL's prefix (`<prefix>/<namespace>/…`, the
//! namespace and node ids escaped so that neither can reach into another's
//! keys):
//!
//! - `members/<node>` — a [`MemberRecord`], attached to the node's etcd
//!   lease (it disappears with the lease);
//! - `leader` — a [`LeaderRecord`], attached to the leader's lease; its
//!   create revision is the leadership term;
//! - `table` — the ownership table (epoch; per partition owner, token and
//!   the token it was handed from), changed only by a transaction comparing
//!   its mod revision with the one read.
//!
//! This file owns the encodings and the layout. It must not talk to etcd
//! or decide anything (the adapter's `presence.rs` and `table.rs` do).

use fief_core::{Assignment, NodeId, OwnershipTable, OwnershipToken, PartitionCount};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::gateway::Op;
use crate::arbiter::ArbiterError;

/// The format of every record this version writes.
pub(super) const FORMAT: u32 = 1;

/// The keys of one namespace.
pub(super) struct Keys {
    /// `<prefix>/<namespace>/`.
    base: String,
}

/// `/` and `%` escaped, so a name is one path segment.
fn escape(name: &str) -> String {
    name.replace('%', "%25").replace('/', "%2F")
}

fn unescape(segment: &str) -> String {
    segment.replace("%2F", "/").replace("%25", "%")
}

impl Keys {
    /// The keys of `namespace` under `prefix` (which starts with `/` and
    /// does not end with one).
    pub(super) fn new(prefix: &str, namespace: &str) -> Keys {
        Keys {
            base: format!("{prefix}/{}/", escape(namespace)),
        }
    }

    fn members_prefix(&self) -> String {
        format!("{}members/", self.base)
    }

    /// A node's member record.
    pub(super) fn member(&self, node: &NodeId) -> String {
        format!("{}{}", self.members_prefix(), escape(node.as_str()))
    }

    /// The bounds of the member records: the prefix, and the prefix with
    /// its final `/` raised to the next byte (excluded).
    pub(super) fn members_bounds(&self) -> (String, String) {
        let start = self.members_prefix();
        let end = format!("{}0", &start[..start.len() - 1]);
        (start, end)
    }

    /// A read of every member record.
    pub(super) fn members(&self) -> Op {
        let (start, end) = self.members_bounds();
        Op::Range(start, end)
    }

    /// The node a member key names.
    pub(super) fn node_of(&self, key: &[u8]) -> Option<NodeId> {
        let key = std::str::from_utf8(key).ok()?;
        let segment = key.strip_prefix(&self.members_prefix())?;
        Some(NodeId::new(unescape(segment)))
    }

    /// The leader record.
    pub(super) fn leader(&self) -> String {
        format!("{}leader", self.base)
    }

    /// The ownership table.
    pub(super) fn table(&self) -> String {
        format!("{}table", self.base)
    }
}

/// A live node, kept under its lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct MemberRecord {
    pub format: u32,
    pub node: String,
    /// Where its peers reach it.
    pub peer_addr: Option<String>,
    /// It is leaving: the leader gives it nothing.
    pub leaving: bool,
    /// The node has used this lease (renewed it or campaigned with it).
    pub confirmed: bool,
}

impl MemberRecord {
    /// A fresh grant's record.
    pub(super) fn new(node: &NodeId, peer_addr: Option<&str>) -> Self {
        MemberRecord {
            format: FORMAT,
            node: node.as_str().to_owned(),
            peer_addr: peer_addr.map(str::to_owned),
            leaving: false,
            confirmed: false,
        }
    }
}

/// The leader, kept under its lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct LeaderRecord {
    pub format: u32,
    pub node: String,
    /// The etcd lease it leads under.
    pub lease: i64,
}

#[derive(Serialize, Deserialize)]
struct TableRecord {
    format: u32,
    partitions: u32,
    epoch: u64,
    owners: Vec<Option<OwnerRecord>>,
}

#[derive(Serialize, Deserialize)]
struct OwnerRecord {
    node: String,
    token: u64,
    handed_from: Option<u64>,
}

/// Just the format number, read before the rest.
#[derive(Deserialize)]
struct Format {
    format: u32,
}

/// `bytes` (at `key`) as a record of `what`.
pub(super) fn decode<T: DeserializeOwned>(
    what: &str,
    key: &str,
    bytes: &[u8],
) -> Result<T, ArbiterError> {
    let not_ours = |e: serde_json::Error| {
        ArbiterError::Refused(format!(
            "the {what} at etcd key {key:?} is not a Fief record ({e}); does something else \
             write under this prefix? Give Fief a prefix of its own"
        ))
    };
    let format: Format = serde_json::from_slice(bytes).map_err(not_ours)?;
    if format.format != FORMAT {
        return Err(ArbiterError::Refused(format!(
            "the {what} at etcd key {key:?} is in format {}, which this Fief does not know \
             (it writes format {FORMAT}); upgrade this node to the version the others run",
            format.format
        )));
    }
    serde_json::from_slice(bytes).map_err(not_ours)
}

/// A record's JSON.
pub(super) fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    serde_json::to_vec(record).expect("records serialize")
}

/// The table's JSON.
pub(super) fn encode_table(table: &OwnershipTable) -> Vec<u8> {
    encode(&TableRecord {
        format: FORMAT,
        partitions: table.partitions().get(),
        epoch: table.epoch(),
        owners: table
            .iter()
            .map(|(_, owner)| {
                owner.map(|a| OwnerRecord {
                    node: a.node.as_str().to_owned(),
                    token: a.token.0,
                    handed_from: a.handed_from.map(|t| t.0),
                })
            })
            .collect(),
    })
}

/// The table stored at `key`, for a namespace of `partitions`.
pub(super) fn decode_table(
    key: &str,
    bytes: &[u8],
    partitions: PartitionCount,
) -> Result<OwnershipTable, ArbiterError> {
    let record: TableRecord = decode("ownership table", key, bytes)?;
    if record.partitions != partitions.get() {
        return Err(ArbiterError::Refused(format!(
            "the namespace has {} partitions at etcd (key {key:?}) but this node is configured \
             with {}; a namespace's partition count is fixed: use {} or another namespace",
            record.partitions,
            partitions.get(),
            record.partitions
        )));
    }
    let owners = record
        .owners
        .into_iter()
        .map(|o| {
            o.map(|o| Assignment {
                node: NodeId::new(o.node),
                token: OwnershipToken(o.token),
                handed_from: o.handed_from.map(OwnershipToken),
            })
        })
        .collect();
    OwnershipTable::from_parts(partitions, record.epoch, owners)
        .map_err(|e| ArbiterError::Refused(format!("the ownership table at etcd key {key:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fief_core::PartitionId;

    #[test]
    fn a_table_round_trips_with_its_tokens() {
        let partitions = PartitionCount::new(3).unwrap();
        let mut table = OwnershipTable::from_parts(partitions, 40, vec![None; 3]).unwrap();
        table.reassign([(PartitionId(0), Some(NodeId::new("a")))]);
        table.hand_over([(PartitionId(0), NodeId::new("b"))]);
        table.reassign([(PartitionId(2), Some(NodeId::new("a")))]);
        let back = decode_table("/t", &encode_table(&table), partitions).unwrap();
        assert_eq!(back, table);
        assert_eq!(
            back.owner(PartitionId(0)).unwrap().handed_from,
            Some(OwnershipToken(41))
        );
        let err =
            decode_table("/t", &encode_table(&table), PartitionCount::new(4).unwrap()).unwrap_err();
        assert!(err.to_string().contains("3 partitions"), "{err}");
    }

    #[test]
    fn a_record_of_another_format_or_writer_is_refused_with_its_key() {
        let newer = br#"{"format":2,"node":"a","lease":1}"#;
        let err = decode::<LeaderRecord>("leader record", "/p/ns/leader", newer).unwrap_err();
        assert!(err.to_string().contains("format 2"), "{err}");
        let err = decode::<LeaderRecord>("leader record", "/p/ns/leader", b"hello").unwrap_err();
        assert!(err.to_string().contains("prefix of its own"), "{err}");
    }

    #[test]
    fn names_are_one_segment_and_members_stay_in_their_namespace() {
        let keys = Keys::new("/fief", "a/members");
        let node = NodeId::new("x/y%z");
        let key = keys.member(&node);
        assert_eq!(key, "/fief/a%2Fmembers/members/x%2Fy%25z");
        assert_eq!(keys.node_of(key.as_bytes()), Some(node));
        let Op::Range(start, end) = keys.members() else {
            panic!("a range")
        };
        assert!(start.as_str() <= key.as_str() && key.as_str() < end.as_str());
        // Namespace `a`'s members range does not hold namespace `a/members`'s.
        let Op::Range(start, end) = Keys::new("/fief", "a").members() else {
            panic!("a range")
        };
        assert!(!(start.as_str() <= key.as_str() && key.as_str() < end.as_str()));
    }
}
