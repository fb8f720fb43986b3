//! Builds the guest components the tests run (the examples and the test
//! guests under `tests/guests/`) from source, for `wasm32-wasip2`; see
//! `guest_build.rs`.

include!("guest_build.rs");

/// Guest packages the tests need.
const GUESTS: &[&str] = &["counter", "room", "probe", "spin", "bomb", "quiet"];

fn main() {
    println!("cargo:rerun-if-changed=guest_build.rs");
    build_guests(GUESTS, "test guests");
}
