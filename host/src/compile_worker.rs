//! The compile worker: compiling a component in a process of its own, so a
//! compile bomb within the static limits ([`crate::module`]) costs the node
//! neither memory nor a compile slot that never comes back.
//!
//! Both sides live here. The *worker* (`fief compile-worker`, hidden) caps
//! its own address space (`RLIMIT_AS`) before it allocates anything, reads a
//! component on stdin, writes `Engine::precompile_component`'s artifact on
//! stdout and exits; it builds its engine with the node's compilation
//! settings ([`engine_config`]), so the artifact loads in the node's engine
//! (wasmtime checks the settings and version again when the node loads it,
//! [`crate::compile_cache::load_artifact`]). The *node* side
//! ([`CompileWorker::precompile`]) runs it, kills it at `compile_timeout`
//! and tells a compile that ran out of memory from one that failed.
//!
//! Must not: hold a compile slot past the worker's death, read more of its
//! output than its address space can hold, or pass the worker's text on
//! uncut.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use bytesize::ByteSize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use wasmtime::{Config, Engine};

pub use crate::config::compile::{DEFAULT_MEMORY_LIMIT, MIN_MEMORY_LIMIT};
use crate::config::{MemoryInit, NodeConfig};
use crate::error::{Error, Result};

/// Guard pages after each linear memory in the pool (the node's engine and
/// the worker's: a compiled artifact is tied to it). Memories are bounded by
/// explicit checks (the reservation is only `max_memory_per_key`), so a
/// small guard is enough.
pub(crate) const MEMORY_GUARD: u64 = 64 * 1024;

/// The worker's exit code when the component does not compile (its reason
/// is on stderr).
const EXIT_INVALID: u8 = 3;

/// Most of a worker's stderr kept for an error message.
const MAX_REASON_BYTES: usize = 4096;

/// Most of a worker's stderr read (a worker saying more is stopped at
/// `compile_timeout`).
const MAX_STDERR_BYTES: u64 = 1 << 20;

/// The node's settings that shape its engine's compiled code: a compiled
/// artifact loads only into an engine of the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineSettings {
    /// `max_memory_per_key`, in bytes: each memory's reservation.
    pub max_memory_per_key: u64,
    /// `memory_init`: whether modules get copy-on-write memory images.
    pub memory_init: MemoryInit,
}

impl EngineSettings {
    /// The settings of a node of `config`.
    pub(crate) fn of(config: &NodeConfig) -> EngineSettings {
        EngineSettings {
            max_memory_per_key: config.max_memory_per_key.as_u64(),
            memory_init: config.memory_init,
        }
    }
}

/// The compilation settings of the node's engine, without its instance
/// allocator (which does not change compiled code). `runtime.rs` builds the
/// node's engine with these and the pool; a test there checks the two agree
/// (`worker_engine_matches_the_node_engine`).
pub(crate) fn engine_config(settings: EngineSettings) -> Config {
    let mut wasm = Config::new();
    wasm.wasm_component_model(true)
        .epoch_interruption(true)
        .memory_reservation(settings.max_memory_per_key)
        .memory_guard_size(MEMORY_GUARD)
        .memory_reservation_for_growth(0)
        .memory_init_cow(settings.memory_init == MemoryInit::CopyOnWrite);
    wasm
}

/// Run the worker: `fief compile-worker --memory-limit BYTES
/// --max-memory-per-key BYTES --memory-init copy|copy-on-write`, the
/// component on stdin, the artifact on stdout. Exits 0 with an artifact,
/// [`EXIT_INVALID`] when the component does not compile, 1 when the worker
/// cannot run; out of memory it aborts (Rust's allocation failure) or says
/// so on stderr.
pub fn serve(memory_limit: u64, settings: EngineSettings) -> ExitCode {
    if let Err(e) = limit_address_space(memory_limit) {
        eprintln!("fief compile-worker: cannot limit its address space: {e}");
        return ExitCode::FAILURE;
    }
    let mut wasm = Vec::new();
    if let Err(e) = std::io::stdin().lock().read_to_end(&mut wasm) {
        eprintln!("fief compile-worker: reading the component from stdin: {e}");
        return ExitCode::FAILURE;
    }
    let engine = match Engine::new(&engine_config(settings)) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("fief compile-worker: cannot create the engine: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let artifact = match engine.precompile_component(&wasm) {
        Ok(artifact) => artifact,
        Err(e) => {
            eprintln!("{e:#}");
            return ExitCode::from(EXIT_INVALID);
        }
    };
    drop(wasm);
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(&artifact).and_then(|()| out.flush()) {
        eprintln!("fief compile-worker: writing the artifact: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// Cap this process's address space at `bytes` (soft and hard).
fn limit_address_space(bytes: u64) -> std::io::Result<()> {
    use rustix::process::{Resource, Rlimit, setrlimit};
    setrlimit(
        Resource::As,
        Rlimit {
            current: Some(bytes),
            maximum: Some(bytes),
        },
    )
    .map_err(std::io::Error::from)
}

/// How the node runs its compile worker.
pub(crate) struct CompileWorker {
    program: PathBuf,
    memory_limit: ByteSize,
    timeout: Duration,
    settings: EngineSettings,
}

impl CompileWorker {
    /// The worker `config` names, if any.
    pub(crate) fn for_node(config: &NodeConfig) -> Option<CompileWorker> {
        Some(CompileWorker {
            program: config.compile_worker.clone()?,
            memory_limit: config.compile_memory_limit,
            timeout: config.compile_timeout,
            settings: EngineSettings::of(config),
        })
    }

    /// Compile `wasm` in a worker process: its artifact, for
    /// [`crate::compile_cache::load_artifact`]. The worker is killed when
    /// this future is dropped or `compile_timeout` passes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidModule`] when the component does not compile, the
    /// compile outlasted `compile_timeout` or needed more than
    /// `compile_memory_limit`; [`Error::Internal`] when the worker cannot be
    /// run or died otherwise.
    pub(crate) async fn precompile(&self, wasm: &[u8]) -> Result<Vec<u8>> {
        let mut child = tokio::process::Command::new(&self.program)
            .arg("compile-worker")
            .arg("--memory-limit")
            .arg(self.memory_limit.as_u64().to_string())
            .arg("--max-memory-per-key")
            .arg(self.settings.max_memory_per_key.to_string())
            .arg("--memory-init")
            .arg(self.settings.memory_init.to_string())
            .env("RUST_LOG", "error")
            // mimalloc (the `mimalloc` feature) reserves address space 1 GiB
            // at a time, which `--memory-limit` (the worker's `RLIMIT_AS`)
            // counts: 32 MiB at a time keeps the limit a measure of what the
            // compile uses (the default left a 512 MiB worker no room for its
            // threads' stacks). Other allocators ignore it.
            .env("MIMALLOC_ARENA_RESERVE", "32M")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| self.cannot_run(&e.to_string()))?;
        let (Some(mut stdin), Some(mut stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(self.cannot_run("its standard streams were not piped"));
        };
        // The artifact cannot be larger than the worker's address space.
        let most = self.memory_limit.as_u64();
        let run = async {
            let feed = async {
                // A worker that dies early closes its stdin: its exit says why.
                let _ = stdin.write_all(wasm).await;
                drop(stdin);
            };
            let mut artifact = Vec::new();
            let mut reason = Vec::new();
            let mut out = (&mut stdout).take(most);
            // Read (almost) all of it, so the worker never blocks on a full
            // pipe; what is kept is cut below.
            let mut err = stderr.take(MAX_STDERR_BYTES);
            let read = out.read_to_end(&mut artifact);
            let read_err = err.read_to_end(&mut reason);
            let ((), read, _) = tokio::join!(feed, read, read_err);
            reason.truncate(MAX_REASON_BYTES);
            let status = child.wait().await;
            (status, read.map(|_| artifact), reason)
        };
        let (status, artifact, reason) =
            tokio::time::timeout(self.timeout, run).await.map_err(|_| {
                Error::InvalidModule(format!(
                    "compiling the component took longer than this node's compile_timeout \
                     ({:?}); the compile was stopped. Build it smaller, or have the operator \
                     raise compile_timeout",
                    self.timeout
                ))
            })?;
        let status = status.map_err(|e| self.cannot_run(&e.to_string()))?;
        let reason = String::from_utf8_lossy(&reason).trim().to_owned();
        if status.success() {
            return artifact.map_err(|e| self.cannot_run(&format!("reading its output: {e}")));
        }
        if out_of_memory(&status, &reason) {
            return Err(Error::InvalidModule(format!(
                "the compile needed more than {} of memory (this node's compile_memory_limit); \
                 build it smaller (fewer or smaller functions), or have the operator raise \
                 compile_memory_limit",
                self.memory_limit
            )));
        }
        if status.code() == Some(i32::from(EXIT_INVALID)) {
            return Err(Error::InvalidModule(format!(
                "the component does not compile: {reason}"
            )));
        }
        Err(Error::Internal(format!(
            "the compile worker {} failed ({status}): {reason}",
            self.program.display()
        )))
    }

    fn cannot_run(&self, why: &str) -> Error {
        Error::Internal(format!(
            "cannot run the compile worker {}: {why} (set compile_worker to the fief binary, \
             or leave it unset to compile in-process)",
            self.program.display()
        ))
    }

    /// The program this worker runs.
    #[cfg(test)]
    fn program(&self) -> &std::path::Path {
        &self.program
    }
}

/// Whether a worker that failed with `status` and said `reason` ran out of
/// its address space: Rust's allocation failure aborts with "memory
/// allocation of N bytes failed"; a failed `mmap` or thread spawn says
/// ENOMEM.
fn out_of_memory(status: &std::process::ExitStatus, reason: &str) -> bool {
    use std::os::unix::process::ExitStatusExt as _;
    const SIGABRT: i32 = 6;
    let said = [
        "memory allocation of",
        "os error 12",
        "Cannot allocate memory",
        "out of memory",
    ]
    .iter()
    .any(|needle| reason.contains(needle));
    said || (status.signal() == Some(SIGABRT) && reason.contains("alloc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_is_configured_only_with_a_program() {
        assert!(CompileWorker::for_node(&NodeConfig::default()).is_none());
        let config = NodeConfig {
            compile_worker: Some("/usr/bin/fief".into()),
            ..NodeConfig::default()
        };
        let worker = CompileWorker::for_node(&config).expect("a worker");
        assert_eq!(worker.program(), std::path::Path::new("/usr/bin/fief"));
    }
}
