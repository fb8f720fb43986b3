//! The compilation cache: compiled components on disk, keyed by the
//! component's content hash and the engine's configuration, so a restarted
//! node (or a redeploy of the same bytes) does not compile again.
//!
//! Compiling is the expensive part of a deploy (milliseconds for a Rust key,
//! seconds for a Python one); loading a cached artifact is a file map. An
//! entry is `<dir>/<sha256 of the component>-<engine hash>.cwasm`, written to
//! a temporary file and renamed into place, so a reader never sees a partial
//! artifact. Anything wrong with the cache (unreadable, stale, corrupt,
//! unwritable) costs a compile and a warning in the log, never a failed
//! deploy.
//!
//! The directory must be writable only by the node's user: a cached artifact
//! is native code that the node maps and runs (see [`CompileCache::load`]).
//! An entry whose component no version in use needs any more (after an
//! undeploy, a redeploy or a rollback) is removed ([`CompileCache::remove`]). This module
//! holds the crate's `unsafe`: loading native code, from the cache or from
//! the compile worker ([`load_artifact`]).

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// The SHA-256 of a component, as lowercase hex: its identity in the cache
/// and in module listings.
pub fn content_hash(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut hex = String::with_capacity(64);
    for byte in digest {
        use std::fmt::Write as _;
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

/// A directory of compiled components for one engine configuration.
pub(crate) struct CompileCache {
    dir: PathBuf,
    /// Distinguishes artifacts of different engine configurations (and
    /// wasmtime versions) sharing one directory.
    engine_tag: String,
}

impl CompileCache {
    /// Open (creating if needed) the cache in `dir` for `engine`.
    ///
    /// # Errors
    ///
    /// A message naming the directory when it cannot be created.
    pub(crate) fn open(dir: &Path, engine: &Engine) -> Result<Self, String> {
        create_private_dir(dir).map_err(|e| {
            format!(
                "cannot create the compile cache directory {}: {e} (pass another --compile-cache directory)",
                dir.display()
            )
        })?;
        Ok(CompileCache {
            dir: dir.to_owned(),
            engine_tag: engine_tag(engine),
        })
    }

    /// The file an artifact of the component with `hash` lives in.
    fn path_for(&self, hash: &str) -> PathBuf {
        self.dir.join(format!("{hash}-{}.cwasm", self.engine_tag))
    }

    /// The cached compilation of the component with content `hash`, if there
    /// is a usable one. A stale or corrupt entry is removed.
    ///
    /// Loading native code: one of the crate's two `unsafe` modules (the
    /// other is `heap_trim.rs`).
    #[allow(
        unsafe_code,
        reason = "deserializing a compiled artifact from our own cache"
    )]
    pub(crate) fn load(&self, engine: &Engine, hash: &str) -> Option<Component> {
        let path = self.path_for(hash);
        if !path.exists() {
            return None;
        }
        // SAFETY: `deserialize_file` maps the file and runs the native code in
        // it, so it must be an artifact wasmtime produced. Only this module
        // writes the cache directory (created private to the node's user,
        // entries renamed into place whole), and wasmtime itself checks the
        // artifact's header, version and engine settings before using it,
        // rejecting anything it did not produce for this configuration.
        match unsafe { Component::deserialize_file(engine, &path) } {
            Ok(component) => Some(component),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "dropping an unusable compile cache entry");
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Store the compilation of the component with content `hash`. Failures
    /// are logged; the deploy goes on without a cache entry.
    pub(crate) fn store(&self, hash: &str, component: &Component) {
        match component.serialize() {
            Ok(bytes) => self.store_artifact(hash, &bytes),
            Err(e) => {
                tracing::warn!(error = %e, "cannot serialize a compiled component for the compile cache");
            }
        }
    }

    /// Store `artifact`, the serialized compilation of the component with
    /// content `hash` (as a compile worker wrote it). Failures are logged.
    pub(crate) fn store_artifact(&self, hash: &str, artifact: &[u8]) {
        let path = self.path_for(hash);
        let result = tempfile_in(&self.dir).and_then(|(temp, mut file)| {
            file.write_all(artifact)?;
            file.sync_all()?;
            std::fs::rename(&temp, &path).inspect_err(|_| {
                let _ = std::fs::remove_file(&temp);
            })
        });
        if let Err(e) = result {
            tracing::warn!(path = %path.display(), error = %e, "cannot write a compile cache entry");
        }
    }

    /// Remove this engine's entries of the components with `hashes` (ones
    /// no version in use needs any more). Returns how many were removed; a
    /// missing entry is not an error, other failures are logged.
    pub(crate) fn remove<'a>(&self, hashes: impl IntoIterator<Item = &'a str>) -> usize {
        let mut removed = 0;
        for hash in hashes {
            let path = self.path_for(hash);
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    removed += 1;
                    tracing::info!(path = %path.display(), "removed a compile cache entry no version in use needs");
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove an unused compile cache entry");
                }
            }
        }
        removed
    }
}

/// Load `artifact`, the serialized compilation of a component made by this
/// node's compile worker ([`crate::compile_worker`]), into `engine`.
///
/// # Errors
///
/// wasmtime's reason when the artifact is not one it made for this engine's
/// settings and version.
#[allow(unsafe_code, reason = "deserializing an artifact this engine compiled")]
pub(crate) fn load_artifact(engine: &Engine, artifact: &[u8]) -> Result<Component, String> {
    // SAFETY: `deserialize` runs the native code in `artifact`, so it must be
    // an artifact wasmtime produced. It is the stdout of the node's own
    // compile worker (the operator's `compile_worker` program, the node's own
    // binary under `fief node`), which wrote `precompile_component`'s output
    // for the component the node gave it, and nothing else writes that pipe;
    // wasmtime checks the artifact's header, version and engine settings
    // before using it, rejecting anything it did not produce for this
    // configuration.
    unsafe { Component::deserialize(engine, artifact) }.map_err(|e| format!("{e:#}"))
}

/// A tag for the engine's compilation settings: artifacts are only
/// compatible with an engine of the same settings and wasmtime version.
fn engine_tag(engine: &Engine) -> String {
    // `DefaultHasher::new()` has fixed keys, so the tag is stable for a given
    // build; a different build may tag differently, which only costs a
    // recompile (and wasmtime's own check rejects incompatible artifacts).
    let mut hasher = std::hash::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

/// Create `dir` (and parents), readable and writable only by this user.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// A new, uniquely named file in `dir`, for writing an entry before it is
/// renamed into place.
fn tempfile_in(dir: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        ".tmp-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let path = dir.join(name);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)?;
    Ok((path, file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_hash_is_sha256_hex() {
        assert_eq!(
            content_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
