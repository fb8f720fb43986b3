// Shared by `tests/build.rs` and `benches/build.rs` (through `include!`):
// build guest components from source for `wasm32-wasip2`.
//
// The guests go into `<target>/guests`, their own target directory, so this
// nested cargo never waits on the lock of the outer build that runs the build
// script (if two build scripts run at once, one nested cargo waits for the
// other). Each component's path reaches the crate as the compile-time env var
// `FIEF_GUEST_<NAME>`.

/// Build `guests` and export their paths; `what` names them in errors.
fn build_guests(guests: &[&str], what: &str) {
    use std::path::PathBuf;
    use std::process::Command;

    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir.parent().unwrap().to_path_buf();
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("guests");
    for dir in [
        "wit",
        "guest-sdk",
        "examples",
        "tests/guests",
        ".cargo/config.toml",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = Command::new(cargo);
    command
        .current_dir(&root)
        .args(["build", "--release", "--target", "wasm32-wasip2"])
        .arg("--target-dir")
        .arg(&target_dir);
    for guest in guests {
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
        "building the {what} failed; is the target installed? `rustup target add wasm32-wasip2`"
    );
    for guest in guests {
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
