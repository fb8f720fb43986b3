//! Fief's coordination core: the decisions that keep every key single-owned.
//!
//! This crate owns the logic of leases, fencing, partitions and routing. It is
//! deterministic and does no I/O: it never reads a clock, opens a socket,
//! spawns a task or draws a random number. Callers pass time in as
//! [`Instant`] values and carry out the decisions it returns. That is what lets
//! tests step time by hand and what lets the simulation drive the very code the
//! node runs. Cargo enforces it: this crate depends on `std` only.
//!
//! The map of the crate:
//! - [`time`]: the monotonic [`Instant`] the core reasons in, and the [`Clock`]
//!   trait the outer layer implements.
//! - [`lease`]: lease timing rules and the node's view of its own lease: when
//!   it must renew and the *fence point* after which it may not act.
//! - [`fence`]: the fence modes (`terminate`, `continue`, `callback`) and the
//!   budget check that a callback deadline fits inside the fence margin.
//! - [`partition`]: the stable key → partition hash, identical in every language.
//! - [`ownership`]: the partition table (partition → owner, epoch, ownership
//!   token) and the routing decision for one key.
//! - [`assignment`]: the leader's decisions (orphans, graceful moves).
//! - [`coordinator`]: the coordination loop as a state machine (join, renew,
//!   lead, follow the table, fence), driven by the node or the simulation.
//! - [`membership`]: the whole ownership protocol of one node (the
//!   coordinator's round, table adoption in order, draining and unsure
//!   partitions, graceful moves, fence, rejoin, leave, the routing view) as
//!   one state machine the node executes and the simulation drives.
//! - [`handoff`]: the handoff states waiting on a node for their keys' next
//!   process (which of them the table says are valid, and which a newer move
//!   attempt superseded), kept by the node and by the simulation alike.
//! - [`arbiter`]: the embedded arbiter's state (leases on the arbiter's clock,
//!   terms, table writes), used by the host's local arbiter and the simulation.
//! - [`storage_fence`]: the fence rule of durable key state (a commit lands
//!   only on its partition's stored fence token; a load raises it, or is
//!   refused when it is higher), run by the host's storage backends and the
//!   simulation's store.
//! - [`alarm`]: the per-node schedule of durable alarms (which stored alarm
//!   of a served partition fires now, retries with backoff, one firing in
//!   flight per alarm), fed by the node's loads, commits and clock.
//! - `sim` (tests, or the `sim` feature): the deterministic simulation of a
//!   cluster with a seeded fault scheduler and a single-ownership checker.

#![forbid(unsafe_code)]

pub mod alarm;
pub mod arbiter;
pub mod assignment;
pub mod coordinator;
pub mod fence;
pub mod handoff;
pub mod history;
pub mod lease;
pub mod membership;
pub mod ownership;
pub mod partition;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
pub mod storage_fence;
pub mod time;

pub use arbiter::{ArbiterState, LeaseId, Member, Term};
pub use coordinator::Coordinator;
pub use fence::{FenceBudget, OnFence};
pub use history::{ArbiterHistory, Regression};
pub use lease::{FenceGate, Lease, LeaseStatus, LeaseTiming, RenewalCounts, TimingError};
pub use membership::{Effect, Membership, MembershipConfig, RoutingView};
pub use ownership::{Assignment, NodeId, OwnershipTable, OwnershipToken, Route, RouteRefusal};
pub use partition::{PartitionCount, PartitionId};
pub use time::{Clock, Instant, ManualClock};
