//! The WebAssembly runtime shared by every key of one instance: the engine,
//! the linker and the epoch ticker.
//!
//! One [`wasmtime::Engine`] per instance with the component model, epoch
//! interruption and the pooling allocator. The [`EpochTicker`] thread bumps
//! the engine's epoch every `epoch_tick`; each key's store checks it at every
//! tick, which is how a kill (or an exhausted CPU budget) interrupts guest code
//! that never calls the host. Contract §2: "the kill does not depend on guest
//! code". The same thread ticks the [`Scheduler`], which reclaims turns held
//! by callbacks that stopped computing. Beside it a [`HeapTrimmer`] returns
//! the host heap to the OS after many keys end.
//!
//! It sits below key processes and names one thing of theirs: `KeyCtx`, the
//! store's data type the linker is built for (`Linker<KeyCtx>`; the imports
//! it binds are implemented on it in `host_api.rs`, `storage_api.rs` and
//! `key/process.rs`). It calls nothing of it and must not: what a key does is
//! the key layer's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use crate::bindings::KeyModule;
use crate::compile_cache::CompileCache;
use crate::compile_worker::{EngineSettings, MEMORY_GUARD, engine_config};
use crate::config::NodeConfig;
use crate::error::{Error, Result};
use crate::heap_trim::{HeapTrimmer, TRIM_MIN_DROP, TRIM_PERIOD};
use crate::key::KeyCtx;
use crate::scheduler::{Scheduler, guest_threads};
use crate::tick_wakes::TickWakes;

/// Core instances a component may have: a Rust guest has 3, a componentize-py
/// guest 14.
const MAX_CORE_INSTANCES_PER_COMPONENT: u32 = 32;

/// The engine, linker and ticker of one instance.
pub(crate) struct Runtime {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<KeyCtx>,
    /// Compiled components on disk, when the node has a cache directory.
    pub(crate) compile_cache: Option<CompileCache>,
    /// The order long callbacks continue in, one turn per guest thread.
    pub(crate) scheduler: Arc<Scheduler>,
    /// Wakes made at the next tick by the ticker thread (an eviction's
    /// victim: `tick_wakes.rs`).
    pub(crate) tick_wakes: Arc<TickWakes>,
    ticker: EpochTicker,
    _trimmer: HeapTrimmer,
}

impl Runtime {
    /// Epoch ticks so far: a coarse clock with no clock read (recency of
    /// keys' use, for eviction), advanced by the ticker thread.
    pub(crate) fn ticks(&self) -> u64 {
        self.ticker.ticks.load(Ordering::Relaxed)
    }
}

impl Runtime {
    /// Build the engine for `config`.
    pub(crate) fn new(config: &NodeConfig) -> Result<Self> {
        let keys = check_map_count(config.max_live_keys)?;
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(keys)
            .total_core_instances(keys.saturating_mul(4))
            .total_memories(memory_slots(config, keys)?)
            .total_tables(keys.saturating_mul(4))
            .total_stacks(keys)
            .max_core_instances_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_memories_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_tables_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_memory_size(config.max_memory_per_key.as_u64() as usize)
            // Dropped stores' slots go back to the pool 64 at a time
            // (wasmtime's decommit queue); a full pool flushes the queue
            // before it refuses. Measured: an
            // evicted key's reactivation ~470 → ~400 µs p50 (docs/benchmarks.md,
            // "Issue 20").
            .decommit_batch_size(DECOMMIT_BATCH as usize);

        let mut wasm = engine_config(EngineSettings::of(config));
        wasm.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
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

        let weights = config
            .tenant_cpu_weights
            .iter()
            .map(|(tenant, weight)| (Arc::from(tenant.as_str()), *weight))
            .collect();
        let scheduler = Arc::new(Scheduler::new(guest_threads(config.guest_threads), weights));
        let tick_wakes = Arc::new(TickWakes::default());
        let ticker = EpochTicker::start(
            engine.clone(),
            scheduler.clone(),
            tick_wakes.clone(),
            config.epoch_tick,
        );
        let trimmer = HeapTrimmer::start(&engine, TRIM_PERIOD, TRIM_MIN_DROP)?;
        Ok(Runtime {
            engine,
            linker,
            compile_cache,
            scheduler,
            tick_wakes,
            ticker,
            _trimmer: trimmer,
        })
    }
}

/// Slots a dropped store's pool slot waits in (wasmtime's decommit queue)
/// before they go back to the pool together.
const DECOMMIT_BATCH: u32 = 64;

/// The instance pool's slots for a node of `max_live_keys`: the budget, and
/// a reserve for the keys ordered to retire to make room for new ones. At
/// the budget a new key starts at once in the reserve while its victim
/// retires (`key/task.rs`, `start_in_pool`); without it, every activation
/// at the budget waited for its victim's store to drop (a thread's wake-up,
/// the victim's `terminate`, the drop, a wake-up back: ~60 µs of a
/// reactivation's ~180 at p50, docs/benchmarks.md, "Issue 20, thirteenth
/// pass"). The reserve covers the slots waiting in the decommit queue
/// twice over, or a sixty-fourth of the budget if more; never more than
/// the budget itself. [`check_map_count`] may give the pool less of it.
pub(crate) fn pool_slots(max_live_keys: u32) -> u32 {
    let reserve = (max_live_keys / 64).max(2 * DECOMMIT_BATCH.min(max_live_keys));
    max_live_keys.saturating_add(reserve.min(max_live_keys))
}

/// Memory mappings (VMAs) the pooling allocator may need per key of
/// `max_live_keys`: two per pooled fiber stack, made for every stack when
/// the pool is created (its guard page splits the pool's mapping; a store
/// keeps its stack while its key lives), and about four per live linear
/// memory (its copy-on-write data image, its accessible pages, pages it grew
/// by, the inaccessible rest of its slot). Measured with the counter example:
/// 2 + 4 (`docs/benchmarks.md`, "Memory").
pub(crate) const MAPPINGS_PER_KEY: u64 = 6;

/// Mappings left for everything else in the process (the heap, threads,
/// libraries, sockets).
const MAPPINGS_SPARE: u64 = 4096;

/// Refuse a `max_live_keys` that the kernel's per-process limit on memory
/// mappings, `vm.max_map_count`, cannot hold: past it, `mmap` and `mprotect`
/// fail and keys fail to start at random. The check counts the mappings the
/// process already has, so several nodes in one process are counted too
/// (those started earlier). Returns the instance pool's slots: the keys and
/// as much of their reserve ([`pool_slots`]) as the limit holds (a pool
/// with none left makes each start at the budget wait for its victim).
fn check_map_count(keys: u32) -> Result<u32> {
    let Some(limit) = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    else {
        // Not Linux, or no /proc: nothing to check against.
        return Ok(pool_slots(keys));
    };
    let used = std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count() as u64)
        .unwrap_or(0);
    let fits = limit.saturating_sub(used + MAPPINGS_SPARE) / MAPPINGS_PER_KEY;
    if u64::from(keys) <= fits {
        return Ok(pool_slots(keys).min(u32::try_from(fits).unwrap_or(u32::MAX)));
    }
    let needed = u64::from(keys) * MAPPINGS_PER_KEY + MAPPINGS_SPARE;
    Err(Error::Config(format!(
        "max_live_keys = {keys} needs up to {needed} memory mappings ({MAPPINGS_PER_KEY} per key \
         and {MAPPINGS_SPARE} spare), but vm.max_map_count is {limit} and this process already \
         uses {used}: raise the limit (`sysctl -w vm.max_map_count={}`) or lower max_live_keys \
         to {fits} or less",
        (used + needed).next_multiple_of(65536)
    )))
}

/// Most address space the memory pool may reserve: 64 TiB of the 128 TiB a
/// process has with 4-level page tables (one reservation of 96 TiB already
/// fails on this project's machines; the stack and table pools need room
/// too).
const MEMORY_POOL_ADDRESS_SPACE: u64 = 64 << 40;

/// Linear memories in the pool: two per key (a component may have more than
/// one), but no more than [`MEMORY_POOL_ADDRESS_SPACE`] holds.
///
/// # Errors
///
/// [`Error::Config`] if not even one memory per key fits.
fn memory_slots(config: &NodeConfig, slots: u32) -> Result<u32> {
    let keys = config.max_live_keys;
    let slot = config.max_memory_per_key.as_u64() + MEMORY_GUARD;
    let fit = u32::try_from(MEMORY_POOL_ADDRESS_SPACE / slot).unwrap_or(u32::MAX);
    if fit < keys {
        return Err(Error::Config(format!(
            "max_live_keys = {keys} memories of max_memory_per_key = {} need more than the \
             {} TiB of address space the memory pool may reserve: lower max_memory_per_key \
             (and the modules' memory_limit) or max_live_keys (at most {fit} keys fit)",
            config.max_memory_per_key,
            MEMORY_POOL_ADDRESS_SPACE >> 40
        )));
    }
    Ok(slots.saturating_mul(2).min(fit))
}

/// A thread that increments the engine's epoch every tick, ticks the
/// scheduler and makes the wakes deferred to the tick, until dropped.
struct EpochTicker {
    stop: Arc<AtomicBool>,
    ticks: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    fn start(
        engine: Engine,
        scheduler: Arc<Scheduler>,
        wakes: Arc<TickWakes>,
        tick: Duration,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ticks = Arc::new(AtomicU64::new(0));
        let thread = {
            let stop = stop.clone();
            let ticks = ticks.clone();
            std::thread::Builder::new()
                .name("fief-epoch".to_owned())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(tick);
                        engine.increment_epoch();
                        ticks.fetch_add(1, Ordering::Relaxed);
                        scheduler.tick();
                        wakes.flush();
                    }
                    // Nothing deferred is left unwoken.
                    wakes.flush();
                })
                .expect("spawning the epoch ticker thread")
        };
        EpochTicker {
            stop,
            ticks,
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

#[cfg(test)]
mod tests {
    use std::hash::{Hash, Hasher};

    use super::*;
    use crate::config::{ByteSize, MemoryInit};

    fn config(keys: u32, memory: ByteSize) -> NodeConfig {
        NodeConfig {
            max_live_keys: keys,
            max_memory_per_key: memory,
            ..NodeConfig::default()
        }
    }

    #[test]
    fn a_million_keys_of_64_mib_fit_the_memory_pool() {
        let slots = memory_slots(&config(1_000_000, ByteSize::mib(64)), pool_slots(1_000_000))
            .expect("they fit");
        assert!(slots >= 1_000_000, "{slots} memory slots");
    }

    #[test]
    fn keys_whose_memories_exceed_the_pool_address_space_are_refused() {
        // 1 000 000 × 256 MiB is 244 TiB: more than the pool may reserve.
        let Err(Error::Config(why)) = memory_slots(
            &config(1_000_000, ByteSize::mib(256)),
            pool_slots(1_000_000),
        ) else {
            panic!("a million 256 MiB memories were accepted");
        };
        assert!(why.contains("max_memory_per_key"), "{why}");
        assert!(why.contains("at most"), "{why}");
    }

    /// The pool holds the budget and a reserve for keys retiring: twice
    /// the decommit queue, a sixty-fourth of a large budget, never more than
    /// the budget itself.
    #[test]
    fn the_pool_keeps_a_reserve_for_keys_retiring() {
        assert_eq!(pool_slots(0), 0);
        assert_eq!(pool_slots(4), 8);
        assert_eq!(pool_slots(1_000), 1_128);
        assert_eq!(pool_slots(100_000), 101_562);
        assert_eq!(pool_slots(u32::MAX), u32::MAX);
    }

    fn hash_of(engine: &Engine) -> u64 {
        let mut hasher = std::hash::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        hasher.finish()
    }

    /// An artifact of the worker loads only into an engine of the same
    /// compilation settings: the worker's must be the node's.
    #[test]
    fn worker_engine_matches_the_node_engine() {
        let mut hashes = Vec::new();
        for memory_init in [MemoryInit::CopyOnWrite, MemoryInit::Copy] {
            let config = NodeConfig {
                max_live_keys: 4,
                memory_init,
                ..NodeConfig::default()
            };
            let runtime = Runtime::new(&config).expect("the node's runtime");
            let worker = Engine::new(&engine_config(EngineSettings::of(&config)))
                .expect("the worker's engine");
            assert_eq!(hash_of(&runtime.engine), hash_of(&worker), "{memory_init}");
            hashes.push(hash_of(&worker));
        }
        // Artifacts of one setting are not taken for the other's (the
        // compile cache keys them by this hash).
        assert_ne!(hashes[0], hashes[1]);
    }
}
