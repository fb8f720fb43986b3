//! A throwaway PostgreSQL server for a test that must stop and start its
//! arbiter (the chaos test restarts it): its own cluster, made with the
//! installed `initdb` in a temporary directory and run with `pg_ctl` on a
//! free port of 127.0.0.1, with trust authentication for user `postgres`.
//! The shared server on 127.0.0.1:5432 that other tests use is never touched.
//!
//! [`ScratchPostgres::copy`] takes an online copy of the data
//! (`pg_basebackup`), and [`ScratchPostgres::replace_with_copy`] crashes the
//! server and starts that earlier copy in its place, on the same port: a
//! primary lost and replaced by a standby that had not received its last
//! commits (asynchronous replication), or by a restored backup.
//!
//! The binaries are looked up in `/usr/lib/postgresql/<version>/bin` (the
//! Debian `postgresql` package, which `scripts/install-test-deps.sh`
//! installs), newest version first, then on `PATH`. PostgreSQL refuses to run
//! as root, so when the test runs as root the server runs as user `postgres`
//! (`runuser`), in a directory owned by it. The server is stopped (immediately) and its
//! directory removed when the [`ScratchPostgres`] is dropped, also when a
//! test panics.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};

/// An online copy of a [`ScratchPostgres`]'s data, from
/// [`ScratchPostgres::copy`].
pub struct PgCopy {
    data: PathBuf,
}

/// A PostgreSQL server of the test's own, stopped and deleted when dropped.
pub struct ScratchPostgres {
    /// The directory holding the data directory, the socket and the log
    /// (under the system's temporary directory; removed when dropped).
    dir: PathBuf,
    /// Where `initdb` and `pg_ctl` are.
    bin: PathBuf,
    /// Run the server as user `postgres` (the test runs as root).
    as_postgres: bool,
    /// The port it listens on, on 127.0.0.1.
    pub port: u16,
}

impl ScratchPostgres {
    /// Make a cluster and start it; panics with PostgreSQL's own words if
    /// that fails. Blocking: call it from `spawn_blocking` in async tests.
    pub fn start() -> ScratchPostgres {
        let bin = postgres_bin_dir();
        let as_postgres = is_root();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fief-scratch-pg-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).expect("creating a temporary directory for PostgreSQL");
        if as_postgres {
            run_ok(Command::new("chown").arg("postgres:").arg(&dir));
        }
        let pg = ScratchPostgres {
            dir,
            bin,
            as_postgres,
            port: crate::free_port(),
        };
        let data = pg.data_dir();
        pg.run_pg(
            "initdb",
            &[
                "-D",
                path_str(&data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        pg.start_again();
        pg
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The URL of its `postgres` database through `addr` (itself, or a
    /// [`crate::multiprocess::TcpProxy`] in front of it).
    pub fn url_via(addr: &str) -> String {
        format!("postgres://postgres@{addr}/postgres")
    }

    /// Start the server (again) and wait until it accepts connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off \
             -c synchronous_commit=off -c full_page_writes=off",
            self.port,
            path_str(&self.dir),
        );
        self.run_pg(
            "pg_ctl",
            &[
                "-D",
                path_str(&self.data_dir()),
                "-l",
                path_str(&self.log_file()),
                "-o",
                &options,
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
    }

    /// Stop the server: `fast` closes every connection at once (clients
    /// see their connection drop, as in a crash of the server) and waits
    /// until it is down.
    pub fn stop(&self) {
        self.pg_ctl_stop("fast");
    }

    /// Copy the running server's data now (`pg_basebackup`, with the WAL
    /// the copy needs to start on its own). Blocking.
    pub fn copy(&self) -> PgCopy {
        static COPIES: AtomicU64 = AtomicU64::new(0);
        let data = self
            .dir
            .join(format!("copy-{}", COPIES.fetch_add(1, Ordering::Relaxed)));
        let port = self.port.to_string();
        self.run_pg(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                path_str(&data),
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
        );
        PgCopy { data }
    }

    /// Crash the server (`pg_ctl stop -m immediate`) and start `copy` in its
    /// place, on the same port: everything committed after the copy was
    /// taken is gone. Blocking.
    pub fn replace_with_copy(&self, copy: PgCopy) {
        let stopped = self.pg_ctl_stop("immediate");
        assert!(
            stopped.status.success(),
            "stopping the server: {}",
            String::from_utf8_lossy(&stopped.stderr)
        );
        let lost = self.dir.join("data-lost");
        let _ = std::fs::remove_dir_all(&lost);
        std::fs::rename(self.data_dir(), &lost).expect("moving the lost data aside");
        std::fs::rename(&copy.data, self.data_dir()).expect("putting the copy in place");
        self.start_again();
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.log_file()).unwrap_or_default()
    }

    fn pg_ctl_stop(&self, mode: &str) -> Output {
        self.command(
            "pg_ctl",
            &[
                "-D",
                path_str(&self.data_dir()),
                "-m",
                mode,
                "-w",
                "-t",
                "60",
                "stop",
            ],
        )
        .output()
        .expect("running pg_ctl stop")
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_file(&self) -> PathBuf {
        self.dir.join("postgres.log")
    }

    /// `bin/<program> <args>`, as user `postgres` when running as root.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let program = self.bin.join(program);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        };
        command.args(args).current_dir(&self.dir);
        command
    }

    fn run_pg(&self, program: &str, args: &[&str]) {
        let output = self
            .command(program, args)
            .output()
            .unwrap_or_else(|e| panic!("running {program}: {e}"));
        assert!(
            output.status.success(),
            "{program} {args:?} failed ({}):\n{}{}\nserver log:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            self.log_text()
        );
    }
}

impl Drop for ScratchPostgres {
    fn drop(&mut self) {
        let stopped = self.pg_ctl_stop("immediate");
        if !stopped.status.success() {
            // Not running (already stopped) is fine; say anything else.
            let text = String::from_utf8_lossy(&stopped.stderr);
            if !text.contains("Is server running?") {
                eprintln!("stopping the scratch PostgreSQL: {text}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory of `initdb` and `pg_ctl`.
fn postgres_bin_dir() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return bin;
    }
    let on_path = Command::new("sh")
        .args(["-c", "command -v initdb"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    match on_path.as_deref().and_then(Path::parent) {
        Some(dir) if dir.join("pg_ctl").exists() => dir.to_owned(),
        _ => panic!(
            "initdb and pg_ctl were not found in /usr/lib/postgresql/*/bin or on PATH. \
             This test runs a PostgreSQL server of its own; install PostgreSQL's server \
             binaries (Debian: apt-get install postgresql; scripts/install-test-deps.sh does)."
        ),
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn run_ok(command: &mut Command) {
    let status = command
        .status()
        .unwrap_or_else(|e| panic!("running {command:?}: {e}"));
    assert!(status.success(), "{command:?} failed: {status}");
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temporary path")
}
