//! The WebAssembly runtime shared by every key of one instance: the engine,
//! the linker and the epoch ticker.
//!
//! One [`wasmtime::Engine`] per instance with the component model, epoch
//! interruption and the pooling allocator. The [`EpochTicker`] thread bumps
//! the engine's epoch every `epoch_tick`; each key's store checks it at every
//! tick, which is how a kill (or an exhausted CPU budget) interrupts guest code
//! that never calls the host. Contract §2: "the kill does not depend on guest
//! code".

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use crate::bindings::KeyModule;
use crate::compile_cache::CompileCache;
use crate::config::NodeConfig;
use crate::error::{Error, Result};
use crate::key::KeyCtx;

/// Guard pages after each linear memory in the pool. Memories are bounded by
/// explicit checks (the reservation is only `max_memory_per_key`), so a small
/// guard is enough.
const MEMORY_GUARD: u64 = 64 * 1024;

/// Core instances a component may have: a Rust guest has 3, a componentize-py
/// guest 14.
const MAX_CORE_INSTANCES_PER_COMPONENT: u32 = 32;

/// The engine, linker and ticker of one instance.
pub(crate) struct Runtime {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<KeyCtx>,
    /// Compiled components on disk, when the node has a cache directory.
    pub(crate) compile_cache: Option<CompileCache>,
    _ticker: EpochTicker,
}

impl Runtime {
    /// Build the engine for `config`.
    pub(crate) fn new(config: &NodeConfig) -> Result<Self> {
        let keys = config.max_live_keys;
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(keys)
            .total_core_instances(keys.saturating_mul(4))
            .total_memories(keys.saturating_mul(2))
            .total_tables(keys.saturating_mul(4))
            .total_stacks(keys)
            .max_core_instances_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_memories_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_tables_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_memory_size(config.max_memory_per_key.as_u64() as usize);

        let mut wasm = Config::new();
        wasm.wasm_component_model(true)
            .epoch_interruption(true)
            .memory_reservation(config.max_memory_per_key.as_u64())
            .memory_guard_size(MEMORY_GUARD)
            .memory_reservation_for_growth(0)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&wasm)
            .map_err(|e| Error::Config(format!("cannot create the wasm engine: {e}")))?;

        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| Error::Internal(format!("linking WASI: {e}")))?;
        KeyModule::add_to_linker::<KeyCtx, HasSelf<KeyCtx>>(&mut linker, |ctx| ctx)
            .map_err(|e| Error::Internal(format!("linking fief:key/host: {e}")))?;

        let compile_cache = match &config.compile_cache {
            Some(dir) => Some(CompileCache::open(dir, &engine).map_err(Error::Config)?),
            None => None,
        };

        let ticker = EpochTicker::start(engine.clone(), config.epoch_tick);
        Ok(Runtime {
            engine,
            linker,
            compile_cache,
            _ticker: ticker,
        })
    }
}

/// A thread that increments the engine's epoch every tick until dropped.
struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    fn start(engine: Engine, tick: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("fief-epoch".to_owned())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(tick);
                        engine.increment_epoch();
                    }
                })
                .expect("spawning the epoch ticker thread")
        };
        EpochTicker {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
