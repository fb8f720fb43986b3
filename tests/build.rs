//! Builds the guest components the tests run from source, for
//! `wasm32-wasip2`: the Rust examples and test guests with cargo (see
//! `guest_build.rs`), and the Python and JavaScript ones with
//! `scripts/build-guest.sh` (componentize-py, componentize-js).

include!("guest_build.rs");

/// Rust guest packages the tests need.
const GUESTS: &[&str] = &[
    "counter",
    "stored-counter",
    "reminders",
    "chat",
    "room",
    "probe",
    "spin",
    "bomb",
    "quiet",
    "hostile",
    "keeper",
    "legacy",
    "vault",
];

/// Python and JavaScript guests the tests need: source directories (with an
/// `app.py` or `app.js`) relative to the workspace root. Each one's path
/// reaches the crate as `FIEF_GUEST_<DIR NAME>` (`FIEF_GUEST_COUNTER_PY`).
const SCRIPT_GUESTS: &[&str] = &[
    "examples/counter-py",
    "examples/counter-js",
    "examples/room-js",
    "examples/chat-js",
    "examples/chat-py",
    "tests/polyglot/probe-py",
    "tests/polyglot/probe-js",
];

fn main() {
    println!("cargo:rerun-if-changed=guest_build.rs");
    build_guests(GUESTS, "test guests");
    build_script_guests(SCRIPT_GUESTS);
}

/// Build the Python and JavaScript guests, all at once, into
/// `<target>/guests/script/`. Fails (never skips) when a toolchain is
/// missing, naming the script that installs it.
fn build_script_guests(guests: &[&str]) {
    use std::path::PathBuf;
    use std::process::{Command, Stdio};

    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap())
        .parent()
        .unwrap()
        .to_path_buf();
    let out_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("guests")
        .join("script");
    let toolchains = std::env::var_os("FIEF_GUEST_TOOLCHAINS")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".guest-toolchains"));
    println!("cargo:rerun-if-env-changed=FIEF_GUEST_TOOLCHAINS");
    for path in [
        root.join("tests/polyglot"),
        root.join("scripts/build-guest.sh"),
        root.join("scripts/guest-toolchains"),
        // Rewritten by scripts/install-guest-toolchains.sh.
        toolchains.join("py.stamp"),
        toolchains.join("js.stamp"),
    ] {
        println!("cargo:rerun-if-changed={}", path.display());
    }

    let builds: Vec<_> = guests
        .iter()
        .map(|dir| {
            let name = dir.rsplit('/').next().unwrap().replace('-', "_");
            let out = out_dir.join(format!("{name}.wasm"));
            let child = Command::new("bash")
                .arg(root.join("scripts/build-guest.sh"))
                .arg(root.join(dir))
                .arg(&out)
                .current_dir(&root)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("running bash scripts/build-guest.sh");
            (dir, name, out, child)
        })
        .collect();
    let mut failures = Vec::new();
    for (dir, name, out, child) in builds {
        let output = child
            .wait_with_output()
            .expect("waiting for build-guest.sh");
        let stderr = String::from_utf8_lossy(&output.stderr);
        if output.status.success() {
            eprint!("{stderr}");
        } else {
            failures.push(format!(
                "{dir}: {}{}",
                String::from_utf8_lossy(&output.stdout),
                stderr
            ));
        }
        println!(
            "cargo:rustc-env=FIEF_GUEST_{}={}",
            name.to_uppercase(),
            out.display()
        );
    }
    assert!(
        failures.is_empty(),
        "building the Python and JavaScript test guests failed (if a toolchain is missing, \
         run scripts/install-guest-toolchains.sh):\n{}",
        failures.join("\n")
    );
}
