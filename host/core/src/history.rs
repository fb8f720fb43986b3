//! What one node has seen of its arbiter's history, and the check that the
//! arbiter never answers from an earlier point of it.
//!
//! An arbiter's counters only go forward: leadership terms, the table's
//! epoch (and with it every ownership token), and each lease's renewal mark
//! (strictly higher at every renewal). An arbiter that answers below what a
//! node has already seen has lost commits: a PostgreSQL standby promoted
//! after asynchronous replication, a database restored from a backup, an
//! etcd cluster rebuilt from an old snapshot. Trusting it can make two nodes
//! own one partition: the lost commits may include renewals, so the arbiter
//! can judge a lease expired that its node still holds, and give the lease's
//! partitions away.
//!
//! [`ArbiterHistory`] keeps the highest of each the node has seen and judges
//! every answer against them; the coordinator fences on a [`Regression`]
//! instead of adopting the answer. It lives as long as the node's process
//! (across fences and rejoins, never across a restart), holds no clock and
//! does no I/O.

use std::fmt;

use crate::arbiter::{LeaseId, Term};
use crate::ownership::OwnershipTable;

/// An arbiter answer from before what this node has seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Regression {
    /// A renewal of `lease` came back with a mark at or below one an
    /// earlier renewal of it returned: renewals this node made were lost.
    Renewal {
        /// The lease renewed.
        lease: LeaseId,
        /// The highest mark seen for it.
        seen: u64,
        /// The mark this renewal returned.
        got: u64,
    },
    /// A leadership term below one this node held.
    Term {
        /// The highest term seen.
        seen: Term,
        /// The term in the answer.
        got: Term,
    },
    /// A table with an epoch below one this node read.
    Epoch {
        /// The highest epoch seen.
        seen: u64,
        /// The epoch in the answer.
        got: u64,
    },
    /// A table at the highest epoch seen, with other owners or tokens: the
    /// arbiter lost that epoch's change and made another under its number.
    Rewritten {
        /// The epoch.
        epoch: u64,
    },
}

impl Regression {
    /// What went back, in a few words (for metrics labels and status).
    pub fn what(&self) -> &'static str {
        match self {
            Regression::Renewal { .. } => "renewal",
            Regression::Term { .. } => "term",
            Regression::Epoch { .. } | Regression::Rewritten { .. } => "epoch",
        }
    }
}

impl fmt::Display for Regression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Regression::Renewal { lease, seen, got } => write!(
                f,
                "the arbiter went back in time: a renewal of lease {} returned mark {got}, \
                 but an earlier renewal of it returned {seen}",
                lease.0
            )?,
            Regression::Term { seen, got } => write!(
                f,
                "the arbiter went back in time: it answered with leadership term {}, \
                 but this node has seen term {}",
                got.0, seen.0
            )?,
            Regression::Epoch { seen, got } => write!(
                f,
                "the arbiter went back in time: its partition table is at epoch {got}, \
                 but this node has read epoch {seen}"
            )?,
            Regression::Rewritten { epoch } => write!(
                f,
                "the arbiter went back in time: its partition table at epoch {epoch} \
                 differs from the one this node read at that epoch"
            )?,
        }
        f.write_str(
            ". It lost commits this node saw (a PostgreSQL standby promoted after \
             asynchronous replication, or a database restored from a backup?). This node \
             fenced instead of trusting it and serves nothing while the arbiter is behind \
             what it saw. Bring back the lost commits, or accept the loss: stop every node, \
             then start them again (docs/operations.md, \"A replicated PostgreSQL, and when the arbiter goes back in time\")",
        )
    }
}

/// The highest term, epoch (with the table at it) and renewal mark this
/// node has seen from its arbiter.
#[derive(Clone, Debug, Default)]
pub struct ArbiterHistory {
    term: Option<Term>,
    table: Option<OwnershipTable>,
    renewal: Option<(LeaseId, u64)>,
}

impl ArbiterHistory {
    /// A node that has seen nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A renewal of `lease` returned `mark`: it must be above every mark an
    /// earlier renewal of the same lease returned (a new lease starts over).
    ///
    /// # Errors
    ///
    /// [`Regression::Renewal`] if it is not; nothing is recorded then.
    pub fn renewed(&mut self, lease: LeaseId, mark: u64) -> Result<(), Regression> {
        match self.renewal {
            Some((l, seen)) if l == lease && mark <= seen => Err(Regression::Renewal {
                lease,
                seen,
                got: mark,
            }),
            _ => {
                self.renewal = Some((lease, mark));
                Ok(())
            }
        }
    }

    /// The arbiter named `term` (this node's own, from a campaign).
    ///
    /// # Errors
    ///
    /// [`Regression::Term`] if a higher term was seen.
    pub fn term(&mut self, term: Term) -> Result<(), Regression> {
        match self.term {
            Some(seen) if term < seen => Err(Regression::Term { seen, got: term }),
            _ => {
                self.term = Some(term);
                Ok(())
            }
        }
    }

    /// The arbiter answered a request sent when this node had seen epoch
    /// `asked_after` ([`ArbiterHistory::epoch`] then) with `table`: its
    /// epoch must not be below that, and if the node still knows no newer
    /// table, at that epoch it must be the table seen. An answer below a
    /// table seen only *after* the request was sent is no regression: two
    /// reads in flight at once (the round's, a refresh's) may answer in
    /// either order, and a node's own write may overtake its earlier read.
    ///
    /// # Errors
    ///
    /// [`Regression::Epoch`] or [`Regression::Rewritten`].
    pub fn table(
        &mut self,
        table: &OwnershipTable,
        asked_after: Option<u64>,
    ) -> Result<(), Regression> {
        if let Some(seen) = asked_after
            && table.epoch() < seen
        {
            return Err(Regression::Epoch {
                seen,
                got: table.epoch(),
            });
        }
        match &self.table {
            Some(seen) if table.epoch() == seen.epoch() && table != seen => {
                Err(Regression::Rewritten {
                    epoch: table.epoch(),
                })
            }
            Some(seen) if table.epoch() <= seen.epoch() => Ok(()),
            _ => {
                self.table = Some(table.clone());
                Ok(())
            }
        }
    }

    /// The highest epoch seen, if any table was.
    pub fn epoch(&self) -> Option<u64> {
        self.table.as_ref().map(OwnershipTable::epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ownership::NodeId;
    use crate::partition::{PartitionCount, PartitionId};

    fn table_with(moves: &[(u32, &str)]) -> OwnershipTable {
        let mut t = OwnershipTable::new(PartitionCount::new(4).unwrap());
        for (p, n) in moves {
            t.reassign([(PartitionId(*p), Some(NodeId::new(n)))]);
        }
        t
    }

    #[test]
    fn a_renewal_mark_must_rise_for_its_lease_and_starts_over_with_a_new_one() {
        let mut h = ArbiterHistory::new();
        h.renewed(LeaseId(7), 3).unwrap();
        h.renewed(LeaseId(7), 4).unwrap();
        let err = h.renewed(LeaseId(7), 4).unwrap_err();
        assert_eq!(
            err,
            Regression::Renewal {
                lease: LeaseId(7),
                seen: 4,
                got: 4
            }
        );
        assert!(err.to_string().contains("went back in time"), "{err}");
        assert!(h.renewed(LeaseId(7), 2).is_err(), "lost renewals");
        h.renewed(LeaseId(8), 1).unwrap();
    }

    #[test]
    fn a_term_may_repeat_but_never_fall() {
        let mut h = ArbiterHistory::new();
        h.term(Term(5)).unwrap();
        h.term(Term(5)).unwrap();
        h.term(Term(6)).unwrap();
        assert_eq!(
            h.term(Term(4)),
            Err(Regression::Term {
                seen: Term(6),
                got: Term(4)
            })
        );
    }

    #[test]
    fn a_table_below_the_epoch_seen_or_rewritten_at_it_is_a_regression() {
        let mut h = ArbiterHistory::new();
        let one = table_with(&[(0, "a")]);
        let two = table_with(&[(0, "a"), (1, "b")]);
        h.table(&one, None).unwrap();
        h.table(&two, Some(1)).unwrap();
        h.table(&two, Some(2)).unwrap();
        assert_eq!(h.epoch(), Some(2));
        assert_eq!(
            h.table(&one, Some(2)),
            Err(Regression::Epoch { seen: 2, got: 1 })
        );
        // The same epoch made again, differently: the arbiter lost the
        // change this node read and wrote another under its number.
        let other = table_with(&[(0, "a"), (1, "c")]);
        assert_eq!(
            h.table(&other, Some(1)),
            Err(Regression::Rewritten { epoch: 2 })
        );
        // Newer tables are taken.
        h.table(&table_with(&[(0, "a"), (1, "b"), (2, "c")]), Some(2))
            .unwrap();
        assert_eq!(h.epoch(), Some(3));
    }

    #[test]
    fn an_answer_overtaken_by_a_newer_table_is_no_regression() {
        let mut h = ArbiterHistory::new();
        let one = table_with(&[(0, "a")]);
        let two = table_with(&[(0, "a"), (1, "b")]);
        h.table(&one, None).unwrap();
        // A read sent at epoch 1; meanwhile the node's own write (or another
        // read) brought epoch 2; the read answers with epoch 1.
        let asked_after = h.epoch();
        h.table(&two, Some(1)).unwrap();
        assert_eq!(h.table(&one, asked_after), Ok(()));
        assert_eq!(h.epoch(), Some(2), "the older answer is not recorded");
        // Sent after epoch 2 was seen, the same answer is a regression.
        assert!(h.table(&one, h.epoch()).is_err());
    }
}
