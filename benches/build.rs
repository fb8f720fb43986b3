//! Builds the `counter`, `stored-counter` and `reminders` examples and the `spin`,
//! `hostile`, `vault` and `probe` test guests from source for `wasm32-wasip2`, with
//! the same code as the tests' build script and into the same target
//! directory, so the tests and the benchmarks share one guest build.

include!("../tests/guest_build.rs");

/// Guest packages the benchmarks need.
const GUESTS: &[&str] = &[
    "counter",
    "stored-counter",
    "reminders",
    "spin",
    "hostile",
    "vault",
    "probe",
];

fn main() {
    println!("cargo:rerun-if-changed=../tests/guest_build.rs");
    build_guests(GUESTS, "benchmark guests");
}
