//! Benchmarks live in `benches/`; see docs/benchmarks.md.
