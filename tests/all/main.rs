//! Fief's integration tests, one binary with one module per area (wasmtime's
//! `tests/all` layout). Each test cites the contract clause or issue item it
//! proves.

mod arbiter;
mod bad_input;
mod cache;
mod ceilings;
mod chaos;
mod cluster;
mod compile_bombs;
mod compile_cache;
mod config;
mod dashboard;
mod deploy;
mod fair_cpu;
mod fence_modes;
mod handoff;
mod host_imports;
mod host_memory;
mod hostile;
mod hostile_logs;
mod http_cli;
mod http_limits;
mod kill;
mod languages;
mod limbo;
mod limits;
mod linearizability;
mod load_fence;
mod observability;
mod processes;
mod runtime;
mod self_fencing;
mod tenants;
mod tidy;
mod tls;
