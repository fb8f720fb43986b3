//! Modules: validating and compiling a `.wasm` component into something a key
//! can be instantiated from.
//!
//! A deploy is checked before anything is stored: the bytes must be a
//! component (not a core module), must compile, must import only what the node
//! grants (`fief:key/host` and WASI p2) and must export `fief:key/lifecycle`.
//! Each failure is an [`Error::InvalidModule`] that says what is wrong and
//! what to do. A compiled module is an [`InstancePre`](wasmtime::component::InstancePre)
//! wrapped by the generated bindings, so activating a key skips all import
//! resolution. Compilation goes through the node's
//! [compile cache](crate::compile_cache) when it has one.

use std::time::{Duration, SystemTime};

use wasmparser::Parser;
use wasmtime::component::Component;

use crate::bindings::KeyModulePre;
use crate::compile_cache::content_hash;
use crate::config::ModuleOptions;
use crate::error::{Error, Result};
use crate::key::KeyCtx;
use crate::runtime::Runtime;

/// Largest component accepted by a deploy.
pub const MAX_MODULE_BYTES: usize = 64 * 1024 * 1024;

/// A compiled, validated module version.
pub struct CompiledModule {
    pub(crate) pre: KeyModulePre<KeyCtx>,
    /// Version number within its module name, starting at 1.
    pub version: u64,
    /// The options its keys run under.
    pub options: ModuleOptions,
    /// Size of the component, in bytes.
    pub size_bytes: usize,
    /// How long compilation (or loading it from the compile cache) took.
    pub compile_time: Duration,
    /// Whether the compilation came from the compile cache.
    pub compile_cached: bool,
    /// SHA-256 of the component, lowercase hex.
    pub content_hash: String,
    /// When it was deployed.
    pub deployed_at: SystemTime,
}

/// Check that `bytes` look like a component before spending time compiling.
fn check_binary_kind(bytes: &[u8]) -> Result<()> {
    if bytes.len() > MAX_MODULE_BYTES {
        return Err(Error::InvalidModule(format!(
            "the component is {} bytes, over the limit of {MAX_MODULE_BYTES} bytes",
            bytes.len()
        )));
    }
    if Parser::is_component(bytes) {
        return Ok(());
    }
    if Parser::is_core_wasm(bytes) {
        return Err(Error::InvalidModule(
            "this is a core WebAssembly module, not a component: build the key module with `cargo build --release --target wasm32-wasip2` (or wrap a core module with `wasm-tools component new`)".to_owned(),
        ));
    }
    Err(Error::InvalidModule(
        "this is not a WebAssembly binary (it does not start with the wasm magic number); upload the .wasm component your build produced".to_owned(),
    ))
}

/// Validate and compile a module. CPU-heavy: call it off the async runtime.
pub(crate) fn compile(
    runtime: &Runtime,
    bytes: &[u8],
    options: ModuleOptions,
    version: u64,
) -> Result<CompiledModule> {
    check_binary_kind(bytes)?;
    let started = std::time::Instant::now();
    let content_hash = content_hash(bytes);
    let cache = runtime.compile_cache.as_ref();
    let cached = cache.and_then(|cache| cache.load(&runtime.engine, &content_hash));
    let compile_cached = cached.is_some();
    let component = match cached {
        Some(component) => component,
        None => Component::new(&runtime.engine, bytes)
            .map_err(|e| Error::InvalidModule(format!("the component does not compile: {e:#}")))?,
    };
    let compile_time = started.elapsed();
    let pre = runtime.linker.instantiate_pre(&component).map_err(|e| {
        Error::InvalidModule(format!(
            "the component needs an import this node does not grant ({e:#}); a key module may import only fief:key/host@0.1.0 and WASI 0.2"
        ))
    })?;
    let pre = KeyModulePre::new(pre).map_err(|e| {
        Error::InvalidModule(format!(
            "the component does not implement the fief:key/key-module@0.1.0 world ({e:#}); it must export fief:key/lifecycle@0.1.0 (with the Rust SDK: `fief_guest::export_key!(YourKey);`)"
        ))
    })?;
    // Cache only what passed validation, so a refused component costs a
    // compile every time but never fills the disk.
    if let (Some(cache), false) = (cache, compile_cached) {
        cache.store(&content_hash, &component);
    }
    Ok(CompiledModule {
        pre,
        version,
        options,
        size_bytes: bytes.len(),
        compile_time,
        compile_cached,
        content_hash,
        deployed_at: SystemTime::now(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_modules_and_garbage_are_told_apart() {
        let core = b"\0asm\x01\0\0\0";
        let err = check_binary_kind(core).unwrap_err().to_string();
        assert!(err.contains("core WebAssembly module"), "{err}");
        let err = check_binary_kind(b"hello").unwrap_err().to_string();
        assert!(err.contains("not a WebAssembly binary"), "{err}");
    }
}
