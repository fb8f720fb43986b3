//! Fief's integration tests, one binary with one module per area (wasmtime's
//! `tests/all` layout). Each test cites the contract clause or issue item it
//! proves.

mod runtime;
