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
//! [compile cache](crate::compile_cache) when it has one, and happens either
//! on a thread of the node ([`compile`]) or in a compile worker process
//! ([`crate::compile_worker`]; [`check`] before it, [`finish`] after).
//!
//! It sits below key processes and names one thing of theirs: `KeyCtx`, the
//! store's data type a module's `InstancePre` is built for
//! (`KeyModulePre<KeyCtx>`, from the runtime's linker). It calls nothing of
//! it and must not run guest code: instantiating a key is the key layer's.

use std::time::{Duration, SystemTime};

use wasmparser::Parser;
use wasmtime::Engine;
use wasmtime::component::{Component, ComponentExportIndex};

use crate::bindings::{KeyModuleIndices, KeyModulePre};
use crate::compile_cache::content_hash;
use crate::config::ModuleOptions;
use crate::error::{Error, Result};
use crate::key::KeyCtx;
use crate::runtime::Runtime;

/// Largest component accepted by a deploy.
pub const MAX_MODULE_BYTES: usize = 64 * 1024 * 1024;

/// Most functions over all core modules of one component. A compile bomb
/// of 400 000 small functions took 30 s of both cores and 2.2 GB; a Python
/// key module (componentize-py) has about 13 000, a JavaScript one 13 000.
pub const MAX_FUNCTIONS: u64 = 100_000;

/// Largest body of one function, in bytes. Single 7 MB functions took
/// 7–21 s and about 4 GB each to compile; the largest in a Python key
/// module is about 430 KB.
pub const MAX_FUNCTION_BYTES: usize = 1024 * 1024;

/// The interfaces of the `fief:key` package a key module may import.
const FIEF_IMPORTS: [&str; 5] = [
    "fief:key/host",
    "fief:key/types",
    "fief:key/storage",
    "fief:key/alarms",
    "fief:key/connections",
];

/// The export that makes a component a key module.
const LIFECYCLE_EXPORT: &str = "fief:key/lifecycle";

/// The versions of the `fief:key` package this node runs (`storage` was
/// added to 0.1.0 without changing its other interfaces: a component built
/// before it imports only `host` and `types`).
const FIEF_VERSIONS: [&str; 1] = ["0.1.0"];

/// Whether `name` is `interface` at one of [`FIEF_VERSIONS`].
fn is_fief(name: &str, interface: &str) -> bool {
    name.split_once('@')
        .is_some_and(|(i, version)| i == interface && FIEF_VERSIONS.contains(&version))
}

/// The WASI 0.2 packages the node links (every key gets them; what they may
/// reach is decided per key: no preopened directory unless the module's
/// options grant one, no network).
const WASI_PACKAGES: [&str; 6] = [
    "wasi:cli",
    "wasi:clocks",
    "wasi:filesystem",
    "wasi:io",
    "wasi:random",
    "wasi:sockets",
];

/// A compiled, validated module version.
pub struct CompiledModule {
    pub(crate) pre: KeyModulePre<KeyCtx>,
    /// Where the world's exports are in each instance, found once here: a
    /// key's start loads them by index, not by name.
    pub(crate) exports: KeyModuleIndices,
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
    /// Whether it imports `fief:key/storage` or `fief:key/alarms`: then
    /// each of its processes loads its key's state before its first
    /// callback.
    pub(crate) uses_storage: bool,
    /// Its `fief:key/alarm-handler` export's `handle-alarm`, if it exports
    /// one (checked at deploy to have the WIT's type): only such a module
    /// may set alarms.
    pub(crate) alarm_handler: Option<ComponentExportIndex>,
    /// Its `fief:key/connection-handler` export's functions, if it exports
    /// one (checked at deploy): only such a module accepts connections.
    pub(crate) connection_handler: Option<ConnectionHandler>,
}

/// The functions of a `fief:key/connection-handler` export.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnectionHandler {
    pub(crate) opened: ComponentExportIndex,
    pub(crate) text: ComponentExportIndex,
    pub(crate) binary: ComponentExportIndex,
    pub(crate) closed: ComponentExportIndex,
}

/// The interface a module exports to accept WebSocket connections.
const CONNECTION_HANDLER: &str = "fief:key/connection-handler@0.1.0";

/// Find the four functions of `component`'s `fief:key/connection-handler`
/// export, each checked to have the WIT's type. `Ok(None)`: it exports none.
fn connection_handler(component: &Component, engine: &Engine) -> Result<Option<ConnectionHandler>> {
    use wasmtime::component::types::{ComponentItem, Type};
    let ty = component.component_type();
    let Some(exported) = ty.get_export(engine, CONNECTION_HANDLER) else {
        return Ok(None);
    };
    let bad = |why: String| {
        Error::InvalidModule(format!(
            "the component exports {CONNECTION_HANDLER} but {why}; it must be the WIT's              (wit/key.wit; with the Rust SDK, implement `Key::connection_*`)"
        ))
    };
    let ComponentItem::ComponentInstance(instance) = exported.ty else {
        return Err(bad("not as an interface".to_owned()));
    };
    let interface = component.get_export_index(None, CONNECTION_HANDLER);
    let find = |name: &str, typed: fn(&[Type]) -> bool| {
        let Some(ComponentItem::ComponentFunc(func)) =
            instance.get_export(engine, name).map(|e| e.ty)
        else {
            return Err(bad(format!("without a `{name}` function")));
        };
        let params: Vec<Type> = func.params().map(|(_, ty)| ty).collect();
        if !typed(&params) || func.results().len() != 0 {
            return Err(bad(format!("its `{name}` has another type")));
        }
        component
            .get_export_index(interface.as_ref(), name)
            .ok_or_else(|| bad(format!("without a `{name}` function")))
    };
    Ok(Some(ConnectionHandler {
        opened: find("connection-opened", |p| {
            matches!(p, [Type::U64, Type::Bool])
        })?,
        text: find("connection-text", |p| {
            matches!(p, [Type::U64, Type::String])
        })?,
        binary: find(
            "connection-binary",
            |p| matches!(p, [Type::U64, list] if matches!(list, Type::List(l) if matches!(l.ty(), Type::U8))),
        )?,
        closed: find("connection-closed", |p| {
            matches!(p, [Type::U64, Type::U16, Type::String])
        })?,
    }))
}

/// The interface a module exports to be woken by its alarms.
const ALARM_HANDLER: &str = "fief:key/alarm-handler@0.1.0";

/// Find `handle-alarm: func(name: string, attempt: u32)` in `component`'s
/// `fief:key/alarm-handler` export. `Ok(None)`: it exports none.
fn alarm_handler(component: &Component, engine: &Engine) -> Result<Option<ComponentExportIndex>> {
    use wasmtime::component::types::ComponentItem;
    let ty = component.component_type();
    let Some(exported) = ty.get_export(engine, ALARM_HANDLER) else {
        return Ok(None);
    };
    let bad = |why: &str| {
        Err(Error::InvalidModule(format!(
            "the component exports {ALARM_HANDLER} but {why}; it must be \
             `handle-alarm: func(name: string, attempt: u32)` (with the Rust SDK, implement \
             `Key::handle_alarm`)"
        )))
    };
    let ComponentItem::ComponentInstance(instance) = exported.ty else {
        return bad("not as an interface");
    };
    let Some(ComponentItem::ComponentFunc(func)) =
        instance.get_export(engine, "handle-alarm").map(|e| e.ty)
    else {
        return bad("without a `handle-alarm` function");
    };
    let params: Vec<_> = func.params().map(|(_, ty)| ty).collect();
    let typed = matches!(
        params.as_slice(),
        [
            wasmtime::component::types::Type::String,
            wasmtime::component::types::Type::U32
        ]
    ) && func.results().len() == 0;
    if !typed {
        return bad("its `handle-alarm` has another type");
    }
    let interface = component.get_export_index(None, ALARM_HANDLER);
    Ok(component.get_export_index(interface.as_ref(), "handle-alarm"))
}

/// Check that `bytes` look like a component before spending time compiling.
fn check_binary_kind(bytes: &[u8]) -> Result<()> {
    if bytes.len() > MAX_MODULE_BYTES {
        return Err(Error::InvalidModule(format!(
            "the component is {} bytes, over the limit of {MAX_MODULE_BYTES} bytes",
            bytes.len()
        )));
    }
    check_header(bytes)
}

/// Check that `prefix` (the first bytes of an upload, 8 are enough) starts
/// a component, so a wrong upload is refused before the rest is read.
pub(crate) fn check_header(prefix: &[u8]) -> Result<()> {
    let bytes = prefix;
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

/// Whether a key module may import `name` (`package:namespace/interface@version`).
fn import_granted(name: &str) -> bool {
    if FIEF_IMPORTS
        .iter()
        .any(|interface| is_fief(name, interface))
    {
        return true;
    }
    let Some((interface, version)) = name.split_once('@') else {
        return false;
    };
    let Some((package, _)) = interface.split_once('/') else {
        return false;
    };
    WASI_PACKAGES.contains(&package) && version.starts_with("0.2.")
}

/// The names a component imports and exports at its top level (not those of
/// the modules and components nested in it).
fn top_level_names(bytes: &[u8]) -> Result<(Vec<String>, Vec<String>)> {
    use wasmparser::Payload;
    let (mut imports, mut exports) = (Vec::new(), Vec::new());
    let mut depth = 0usize;
    let malformed = |e: wasmparser::BinaryReaderError| {
        Error::InvalidModule(format!(
            "the component is malformed ({e}); rebuild it, or check the upload was not truncated"
        ))
    };
    for payload in Parser::new(0).parse_all(bytes) {
        match payload.map_err(malformed)? {
            Payload::ModuleSection { .. } | Payload::ComponentSection { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            Payload::ComponentImportSection(reader) if depth == 0 => {
                for import in reader {
                    imports.push(import.map_err(malformed)?.name.name.to_owned());
                }
            }
            Payload::ComponentExportSection(reader) if depth == 0 => {
                for export in reader {
                    exports.push(export.map_err(malformed)?.name.name.to_owned());
                }
            }
            _ => {}
        }
    }
    Ok((imports, exports))
}

/// Check what a component imports and exports before compiling it: every
/// import must be one the node grants, and it must export the key
/// lifecycle. Each refusal names the import or export at fault.
fn check_interface(bytes: &[u8]) -> Result<()> {
    let (imports, exports) = top_level_names(bytes)?;
    if let Some(import) = imports.iter().find(|name| !import_granted(name)) {
        return Err(Error::InvalidModule(format!(
            "the component imports `{import}`, which a key module may not import: the node grants only fief:key/host, fief:key/storage, fief:key/alarms and fief:key/types (versions {}) and the WASI 0.2 interfaces ({}); build the module without that dependency, or against a fief:key version this node runs",
            FIEF_VERSIONS.join(", "),
            WASI_PACKAGES.join(", ")
        )));
    }
    if !exports.iter().any(|name| is_fief(name, LIFECYCLE_EXPORT)) {
        let found = if exports.is_empty() {
            "nothing".to_owned()
        } else {
            exports.join(", ")
        };
        return Err(Error::InvalidModule(format!(
            "the component does not implement the fief:key/key-module world: it exports {found}, not {LIFECYCLE_EXPORT}@{} (with the Rust SDK: `fief_guest::export_key!(YourKey);`)",
            FIEF_VERSIONS.join(" or @")
        )));
    }
    Ok(())
}

/// Refuse a component whose keys could never start: a core module whose
/// memory starts larger than the module's `memory_limit` (it would fail on
/// every call, or speak of the pooling allocator's slots), or whose active
/// data segment lies outside the memory it initializes. Checked statically,
/// from the binary, before anything is compiled or stored.
fn check_memories(bytes: &[u8], options: &ModuleOptions) -> Result<()> {
    use wasmparser::{ConstExpr, DataKind, Operator, Payload, TypeRef};
    let limit = options.memory_limit.as_u64();
    let invalid = |e: wasmparser::BinaryReaderError| {
        Error::InvalidModule(format!("the component is not valid WebAssembly: {e}"))
    };
    /// The constant offset of an active data segment, when it is one.
    fn constant(expr: &ConstExpr<'_>) -> Option<u64> {
        match expr.get_operators_reader().read().ok()? {
            Operator::I32Const { value } => Some(u64::from(value as u32)),
            Operator::I64Const { value } => Some(value as u64),
            _ => None,
        }
    }
    // Per core module (each starts with a `Version` payload): whether its
    // memory 0 is imported, and the initial size of the one it defines.
    let mut imported_memories = 0u32;
    let mut defined: Vec<u64> = Vec::new();
    for payload in Parser::new(0).parse_all(bytes) {
        match payload.map_err(invalid)? {
            Payload::Version { .. } => {
                imported_memories = 0;
                defined.clear();
            }
            Payload::ImportSection(reader) => {
                for group in reader {
                    for import in group.map_err(invalid)? {
                        if matches!(import.map_err(invalid)?.1.ty, TypeRef::Memory(_)) {
                            imported_memories += 1;
                        }
                    }
                }
            }
            Payload::MemorySection(reader) => {
                for memory in reader {
                    let memory = memory.map_err(invalid)?;
                    // `page_size()` would overflow on a bogus custom page
                    // size (the parser takes a log2 up to 63; validation,
                    // later, refuses it): compute it without overflow.
                    let page = 1u64
                        .checked_shl(memory.page_size_log2())
                        .unwrap_or(u64::MAX);
                    let initial = memory.initial.saturating_mul(page);
                    if initial > limit {
                        return Err(Error::InvalidModule(format!(
                            "the component's memory starts at {} ({} pages), over the module's \
                             memory_limit ({}); deploy it with a larger memory_limit (at most \
                             the node's max_memory_per_key) or build it with a smaller initial \
                             memory",
                            bytesize::ByteSize::b(initial),
                            memory.initial,
                            options.memory_limit
                        )));
                    }
                    defined.push(initial);
                }
            }
            Payload::DataSection(reader) => {
                for data in reader {
                    let data = data.map_err(invalid)?;
                    let DataKind::Active {
                        memory_index,
                        offset_expr,
                    } = data.kind
                    else {
                        continue;
                    };
                    // Only segments of a memory this module defines, at a
                    // constant offset: an imported memory's size is not
                    // known here.
                    let Some(local) = memory_index.checked_sub(imported_memories) else {
                        continue;
                    };
                    let (Some(size), Some(offset)) =
                        (defined.get(local as usize), constant(&offset_expr))
                    else {
                        continue;
                    };
                    let end = offset.saturating_add(data.data.len() as u64);
                    if end > *size {
                        return Err(Error::InvalidModule(format!(
                            "a data segment of the component writes bytes {offset}..{end} of a \
                             memory of {size} bytes: it is out of bounds, so every key would \
                             fail to start; rebuild the module"
                        )));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Refuse a compile bomb before compiling it: more than [`MAX_FUNCTIONS`]
/// functions, or one over [`MAX_FUNCTION_BYTES`]. Compile time and memory
/// grow with both; past them a deploy costs the node more than any real key
/// module does.
fn check_code_size(bytes: &[u8]) -> Result<()> {
    use wasmparser::Payload;
    let mut functions = 0u64;
    for payload in Parser::new(0).parse_all(bytes) {
        let payload = payload.map_err(|e| {
            Error::InvalidModule(format!("the component is not valid WebAssembly: {e}"))
        })?;
        match payload {
            Payload::CodeSectionStart { count, .. } => {
                functions += u64::from(count);
                if functions > MAX_FUNCTIONS {
                    return Err(Error::InvalidModule(format!(
                        "the component has over {MAX_FUNCTIONS} functions ({functions} so far): \
                         compiling it would cost the node more than any key module should; \
                         split it or build it smaller"
                    )));
                }
            }
            Payload::CodeSectionEntry(body) => {
                let size = body.range().len();
                if size > MAX_FUNCTION_BYTES {
                    return Err(Error::InvalidModule(format!(
                        "a function of the component is {size} bytes, over the limit of \
                         {MAX_FUNCTION_BYTES}: compiling it would take seconds and gigabytes; \
                         split the function"
                    )));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A component that passed the static checks, before it is compiled.
pub(crate) struct Checked {
    /// SHA-256 of the component, lowercase hex.
    pub(crate) content_hash: String,
    /// Its compiled code, when the node's compile cache has it.
    pub(crate) cached: Option<Component>,
}

/// Where a module's compiled code came from.
pub(crate) enum Code {
    /// The compile cache.
    Cached(Component),
    /// Compiled on a thread of the node.
    Compiled(Component),
    /// A compile worker's artifact ([`crate::compile_worker`]), not loaded
    /// yet.
    Artifact(Vec<u8>),
}

/// Run the static checks on a component and look it up in the compile
/// cache: everything before compiling. Parses the whole component: call it
/// off the async runtime.
///
/// # Errors
///
/// [`Error::InvalidModule`] saying what is wrong.
pub(crate) fn check(runtime: &Runtime, bytes: &[u8], options: &ModuleOptions) -> Result<Checked> {
    check_binary_kind(bytes)?;
    check_interface(bytes)?;
    check_memories(bytes, options)?;
    check_code_size(bytes)?;
    let content_hash = content_hash(bytes);
    let cached = runtime
        .compile_cache
        .as_ref()
        .and_then(|cache| cache.load(&runtime.engine, &content_hash));
    Ok(Checked {
        content_hash,
        cached,
    })
}

/// Make a module version of checked, compiled `code`: its `InstancePre`,
/// checked against the node's linker and the key-module world, and its
/// compilation stored in the compile cache if it did not come from there.
/// `compile_time` is how long getting `code` took.
///
/// # Errors
///
/// [`Error::InvalidModule`] when it needs an import the node does not grant
/// or is not a key module; [`Error::Internal`] when a worker's artifact does
/// not load.
pub(crate) fn finish(
    runtime: &Runtime,
    checked: Checked,
    code: Code,
    size_bytes: usize,
    options: ModuleOptions,
    version: u64,
    compile_time: std::time::Duration,
) -> Result<CompiledModule> {
    let Checked { content_hash, .. } = checked;
    let compile_cached = matches!(code, Code::Cached(_));
    let (component, artifact) = match code {
        Code::Cached(component) | Code::Compiled(component) => (component, None),
        Code::Artifact(artifact) => (
            crate::compile_cache::load_artifact(&runtime.engine, &artifact).map_err(|e| {
                Error::Internal(format!(
                    "the compile worker's artifact does not load into this node's engine ({e});                      the compile_worker program must be the same fief build as the node"
                ))
            })?,
            Some(artifact),
        ),
    };
    build_memory_images(&component);
    let uses_storage = component
        .component_type()
        .imports(&runtime.engine)
        .any(|(name, _)| {
            name.starts_with("fief:key/storage") || name.starts_with("fief:key/alarms")
        });
    let alarm_handler = alarm_handler(&component, &runtime.engine)?;
    let connection_handler = connection_handler(&component, &runtime.engine)?;
    let pre = runtime.linker.instantiate_pre(&component).map_err(|e| {
        Error::InvalidModule(format!(
            "the component needs an import this node does not grant ({e:#}); a key module may import only fief:key/host, fief:key/storage, fief:key/alarms and WASI 0.2"
        ))
    })?;
    let pre = KeyModulePre::new(pre).map_err(|e| {
        Error::InvalidModule(format!(
            "the component does not implement the fief:key/key-module world ({e:#}); it must export fief:key/lifecycle@0.1.0 (with the Rust SDK: `fief_guest::export_key!(YourKey);`)"
        ))
    })?;
    // Cache only what passed validation, so a refused component costs a
    // compile every time but never fills the disk.
    if let (Some(cache), false) = (runtime.compile_cache.as_ref(), compile_cached) {
        match artifact {
            Some(artifact) => cache.store_artifact(&content_hash, &artifact),
            None => cache.store(&content_hash, &component),
        }
    }
    let exports = KeyModuleIndices::new(pre.instance_pre())
        .map_err(|e| Error::InvalidModule(format!("the component's exports: {e:#}")))?;
    Ok(CompiledModule {
        pre,
        exports,
        version,
        options,
        size_bytes,
        compile_time,
        compile_cached,
        content_hash,
        deployed_at: SystemTime::now(),
        uses_storage,
        alarm_handler,
        connection_handler,
    })
}

/// Pauses between attempts at building a module's memory images: the
/// kernel itself waits up to ~150 ms inside each attempt.
const IMAGE_RETRY_PAUSES: [Duration; 4] = [
    Duration::from_millis(10),
    Duration::from_millis(40),
    Duration::from_millis(160),
    Duration::from_millis(640),
];

/// Build the copy-on-write images of `component`'s memories now, at deploy
/// time, instead of wasmtime's default: lazily, inside the first key's
/// instantiation.
///
/// On Linux an image is a sealed memfd, and sealing it against writes
/// (`F_ADD_SEALS`) fails with `EBUSY` while the kernel still holds a
/// transient reference to one of the pages just written (CI saw a Python
/// key's activation fail so). Doing it here keeps that off every key's
/// path, and a failed attempt is retried with a fresh memfd after a pause
/// ([`IMAGE_RETRY_PAUSES`]). Should every attempt fail, the deploy still
/// goes on, with a warning: wasmtime does not remember the failure and
/// tries again at the next activation. Does nothing when the node copies
/// initial memory (`memory_init = "copy"`). Blocks: call it off the async
/// runtime.
fn build_memory_images(component: &Component) {
    if let Err(e) = with_retries(&IMAGE_RETRY_PAUSES, || {
        component.initialize_copy_on_write_image()
    }) {
        tracing::warn!(
            error = %format!("{e:#}"),
            attempts = IMAGE_RETRY_PAUSES.len() + 1,
            "cannot build a module's memory image; its keys' activations will try again"
        );
    }
}

/// Run `attempt` until it succeeds, pausing for each of `pauses` in turn
/// after a failure; the last failure when all `pauses.len() + 1` fail.
fn with_retries<E>(
    pauses: &[Duration],
    mut attempt: impl FnMut() -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    for pause in pauses {
        match attempt() {
            Ok(()) => return Ok(()),
            Err(_) => std::thread::sleep(*pause),
        }
    }
    attempt()
}

/// Validate and compile a module on this thread. CPU-heavy: call it off
/// the async runtime.
pub(crate) fn compile(
    runtime: &Runtime,
    bytes: &[u8],
    options: ModuleOptions,
    version: u64,
) -> Result<CompiledModule> {
    let mut checked = check(runtime, bytes, &options)?;
    let started = std::time::Instant::now();
    let code =
        match checked.cached.take() {
            Some(component) => Code::Cached(component),
            None => Code::Compiled(Component::new(&runtime.engine, bytes).map_err(|e| {
                Error::InvalidModule(format!("the component does not compile: {e:#}"))
            })?),
        };
    finish(
        runtime,
        checked,
        code,
        bytes.len(),
        options,
        version,
        started.elapsed(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_attempt_is_retried_after_each_pause_and_the_last_failure_is_returned() {
        let pauses = [Duration::ZERO; 3];
        let mut calls = 0;
        let outcome = with_retries(&pauses, || {
            calls += 1;
            if calls < 3 { Err(calls) } else { Ok(()) }
        });
        assert_eq!(
            (outcome, calls),
            (Ok(()), 3),
            "succeeds at its third attempt"
        );
        let mut calls = 0;
        let outcome = with_retries(&pauses, || {
            calls += 1;
            Err::<(), _>(calls)
        });
        assert_eq!(outcome, Err(4), "four attempts, then the last failure");
    }

    /// A component exporting `fief:key/alarm-handler` whose `handle-alarm`
    /// takes `params` (WAT component-model types).
    fn handler_component(engine: &Engine, params: &str) -> Component {
        let text = format!(
            r#"(component
                (core module $m (func (export "f") (param i32 i32)))
                (core instance $i (instantiate $m))
                (func $f {params} (canon lift (core func $i "f")))
                (instance $h (export "handle-alarm" (func $f)))
                (export "fief:key/alarm-handler@0.1.0" (instance $h)))"#
        );
        let bytes = wat::parse_str(&text).expect("the WAT parses");
        Component::new(engine, bytes).expect("the component compiles")
    }

    /// Deploy's check of the alarm handler: none exported is no handler; one
    /// whose `handle-alarm` has another type than the WIT's is refused,
    /// naming the type it must have.
    #[test]
    fn an_alarm_handler_of_another_type_is_refused_at_deploy() {
        let mut config = wasmtime::Config::new();
        config.wasm_component_model(true);
        let engine = Engine::new(&config).expect("an engine");
        let none = Component::new(&engine, wat::parse_str("(component)").expect("WAT"))
            .expect("the empty component");
        assert!(alarm_handler(&none, &engine).expect("no handler").is_none());
        let wrong = handler_component(&engine, r#"(param "name" u32) (param "attempt" u32)"#);
        let err = alarm_handler(&wrong, &engine).unwrap_err().to_string();
        assert!(err.contains("another type"), "{err}");
        assert!(
            err.contains("handle-alarm: func(name: string, attempt: u32)"),
            "{err}"
        );
    }

    /// A custom page size of 2^40 bytes (log2 40, which the parser takes and
    /// validation would refuse) must not overflow the memory check.
    #[test]
    fn a_bogus_custom_page_size_is_refused_not_a_panic() {
        // A core module: one memory, flags 0x08 (custom page size), 1 page,
        // page size log2 40.
        let module = b"\0asm\x01\0\0\0\x05\x04\x01\x08\x01\x28";
        let err = check_memories(module, &ModuleOptions::default()).unwrap_err();
        assert!(
            err.to_string().contains("over the module's memory_limit"),
            "{err}"
        );
    }

    #[test]
    fn core_modules_and_garbage_are_told_apart() {
        let core = b"\0asm\x01\0\0\0";
        let err = check_binary_kind(core).unwrap_err().to_string();
        assert!(err.contains("core WebAssembly module"), "{err}");
        let err = check_binary_kind(b"hello").unwrap_err().to_string();
        assert!(err.contains("not a WebAssembly binary"), "{err}");
    }

    #[test]
    fn only_fief_and_wasi_0_2_imports_are_granted() {
        assert!(import_granted("fief:key/host@0.1.0"));
        assert!(import_granted("fief:key/storage@0.1.0"));
        assert!(!import_granted("fief:key/host@0.1.1"));
        assert!(!import_granted("fief:key/host"));
        assert!(import_granted("wasi:io/streams@0.2.3"));
        assert!(import_granted("wasi:sockets/tcp@0.2.0"));
        assert!(!import_granted("wasi:http/outgoing-handler@0.2.0"));
        assert!(!import_granted("wasi:io/streams@0.3.0"));
        assert!(!import_granted("fief:key/host@0.2.0"));
        assert!(!import_granted("env"));
    }
}
