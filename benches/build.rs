//! Builds the `counter` example guest from source for `wasm32-wasip2`, the
//! same way `tests/build.rs` does and into the same target directory
//! (`<target>/guests`), so the tests and the benchmarks share one guest
//! build. A nested cargo in its own target directory never waits on the outer
//! build's lock; if the tests' build script runs at the same time, one nested
//! cargo simply waits for the other. The component's path reaches the
//! benchmarks as the compile-time env var `FIEF_GUEST_COUNTER`.

use std::path::PathBuf;
use std::process::Command;

/// Guest packages the benchmarks need.
const GUESTS: &[&str] = &["counter"];

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir.parent().unwrap().to_path_buf();
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("guests");
    for dir in ["wit", "guest-sdk", "examples", ".cargo/config.toml"] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = Command::new(cargo);
    command
        .current_dir(&root)
        .args(["build", "--release", "--target", "wasm32-wasip2"])
        .arg("--target-dir")
        .arg(&target_dir);
    for guest in GUESTS {
        command.args(["-p", guest]);
    }
    // The outer build's flags are for the host; the guests take theirs from
    // .cargo/config.toml.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_TARGET_DIR",
    ] {
        command.env_remove(var);
    }
    let status = command.status().expect("running cargo to build the guests");
    assert!(
        status.success(),
        "building the benchmark guests failed; is the target installed? `rustup target add wasm32-wasip2`"
    );
    for guest in GUESTS {
        let path = target_dir
            .join("wasm32-wasip2/release")
            .join(format!("{}.wasm", guest.replace('-', "_")));
        println!(
            "cargo:rustc-env=FIEF_GUEST_{}={}",
            guest.to_uppercase().replace('-', "_"),
            path.display()
        );
    }
}
