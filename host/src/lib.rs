//! Fief: a runtime for WebAssembly key processes with strict single ownership.
//!
//! Applications have keys (a session, a device, a room). Fief backs each key
//! with one live *key process*: an instance of a WebAssembly component that
//! implements the `fief:key` world. Keys hash to partitions, partitions are
//! owned by nodes, and a node owns only under a lease from an arbiter; a node
//! that cannot prove its lease current fences itself and kills its keys
//! before anyone else may take over.
//!
//! Start an [`Instance`] inside your tokio program, [`Instance::deploy`] a
//! module, and [`Instance::call`] its keys. The `fief` binary is a thin CLI
//! and HTTP server over this library. See `ARCHITECTURE.md` for the map.

pub mod arbiter;
pub mod auth;
// Public only for the benches' raw-wasmtime baseline
// (benches/benches/common/mod.rs implements these bindings' `Host` traits on a
// bare store, to measure Fief against wasmtime alone); not API.
#[doc(hidden)]
pub mod bindings;
pub mod cache;
mod clock;
pub mod compile_cache;
pub mod compile_worker;
pub mod config;
mod cpu_budget;
mod dashboard;
mod dashboard_history;
mod dedicated;
mod error;
pub mod event_log;
// Public only for the cargo-fuzz targets (fuzz/fuzz_targets/), a workspace
// of their own that can reach nothing private; not API.
mod connections;
mod connections_api;
#[doc(hidden)]
pub mod fuzz;
mod guest_log;
mod guest_priority;
mod handoff;
mod heap_trim;
mod host_api;
mod host_bytes;
pub mod http;
pub mod http_limits;
mod http_modules;
mod inline_share;
mod key;
#[cfg(test)]
mod layers;
mod limbo;
mod line_budget;
mod listener;
mod load_ceilings;
mod mailbox;
mod metrics;
pub mod module;
mod node;
pub mod openapi;
mod peer_auth;
mod probes;
mod pubsub;
mod request_turns;
mod runtime;
mod sandbox;
mod scheduler;
pub mod storage;
mod storage_api;
mod sync;
mod tick_wakes;
pub mod tls;
mod token_bucket;
mod trace;
mod transport;
mod wire;

pub use bindings::types::StopReason;
pub use cache::{Cache, CacheEntry, CacheStats};
pub use clock::{NodeClock, SteppedClock, TokioClock};
pub use config::{CpuCores, DirGrant, ModuleCeilings, ModuleOptions, NodeConfig};
pub use cpu_budget::TenantCpuReport;
pub use dashboard::{ClusterView, ModuleView};
pub use dashboard_history::{NodeHistory, Sample};
pub use error::{Error, Result};
pub use fief_core as core;
pub use handoff::LostState;
pub use host_bytes::{Refusal, TenantHostBytes};
pub use key::{KeyLife, KeyLifeEvent, KeyLifeObserver, LiveKey};
pub use limbo::LimboEntry;
pub use node::{
    Instance, InstanceBuilder, LeaseState, LeaveReport, ModuleInfo, ModuleListing, NodeStatus,
    Readiness, ReadyState, Status, StoredAlarmView,
};
pub use sandbox::TenantLimits;
