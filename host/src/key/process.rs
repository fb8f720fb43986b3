//! A running key process: its store and the instance in it.
//!
//! This file owns what happens inside one key's store: the store's data
//! (`KeyCtx`: the key's WASI context, limits, CPU accounting, timers and
//! subscriptions), the side-effect gate every effectful import calls first,
//! the epoch callback (kill flag, fence point, CPU limit, yielding to the
//! scheduler), instantiation and `init`, the guest's callbacks, the words
//! that say why a process died, the cell its task and inline callers share
//! (`ProcessCell`), and the key's timers (`arm_timer`). It must not decide
//! when a key runs or which message comes next (the key's task does,
//! `task.rs`), nor touch its module's table of live keys (`slot.rs`).

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use fief_core::alarm::FireOutcome;
use fief_core::{OnFence, OwnershipToken, PartitionId};
use tokio::task::AbortHandle;
use wasmtime::component::ResourceTable;
use wasmtime::{Store, Trap, UpdateDeadline};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::storage::KeyStorage;
use super::{Envelope, KeyControl, KeyNode, KeyServices};
use crate::bindings::KeyModule;
use crate::bindings::types::{FenceDecision, Info, StopReason, TimerFired};
use crate::cpu_budget::{CpuBudget, CpuMeter};
use crate::error::{Error, Result};
use crate::guest_log::{GuestLogger, LogLimits, MAX_GUEST_ERROR, bounded};
use crate::host_bytes::Held;
use crate::mailbox::WeakMailbox;
use crate::module::CompiledModule;
use crate::sandbox::PublishBucket;
use crate::scheduler::{Scheduler, Seat};
use crate::trace::TraceContext;
use crate::wire::ConnEvent;

/// Most elements one table of a key may grow to (`table.grow` past it traps
/// the key); the pool's per-table slot may be smaller.
const MAX_TABLE_ELEMENTS: usize = 100_000;

/// A key's process, shared by its task and by callers that run a call
/// inline while the key is idle. Whoever holds the lock may run guest code;
/// `None` once the store has been dropped (or before it is created).
pub(super) type ProcessCell = tokio::sync::Mutex<Option<KeyProcess>>;

/// The key's process, held (by its task or an inline caller).
pub(super) type ProcessGuard = tokio::sync::OwnedMutexGuard<Option<KeyProcess>>;

/// What a key process knows about itself and its node.
pub(crate) struct KeyEnv {
    pub(crate) module: Arc<str>,
    pub(crate) key: Arc<str>,
    pub(crate) token: OwnershipToken,
    /// The key's partition (with `token`, what its storage commits are
    /// fenced by).
    pub(crate) partition: PartitionId,
    pub(crate) control: Arc<KeyControl>,
    pub(crate) mailbox: WeakMailbox,
    /// What the key uses of its node (weak: the node holds the key's
    /// store, through its module's table).
    pub(crate) services: Weak<KeyServices>,
    pub(crate) generation: u64,
    pub(crate) on_fence: OnFence,
    pub(crate) max_timers: u32,
    pub(crate) max_subscriptions: u32,
    /// The largest handoff state this key may hand on (the module's
    /// `max_handoff_size` under the node's message limit).
    pub(crate) max_handoff: usize,
}

/// The data of a key's store.
pub(crate) struct KeyCtx {
    /// Made on the key's first WASI call unless its module has a directory
    /// (`crate::sandbox::wasi_ctx`).
    wasi: Option<WasiCtx>,
    table: ResourceTable,
    limits: super::linear_memory::KeyLimiter,
    memory_limit: usize,
    pub(crate) env: Arc<KeyEnv>,
    cpu_ticks: u64,
    cpu_limit_ticks: u64,
    /// One epoch tick, in nanoseconds (host time is charged in ticks).
    tick_nanos: u64,
    /// Host time charged but short of a whole tick, in nanoseconds.
    host_nanos: u64,
    /// The key's log: the `log` import, stdout and stderr.
    pub(crate) log: Arc<GuestLogger>,
    /// Set when the epoch callback yielded: the first epoch check after the
    /// guest resumes calls back again (see the callback).
    resuming: bool,
    /// Set while a callback runs inline on a caller's task: its first yield
    /// demotes it to the key's task (see [`InlineCall`](super::inline::InlineCall)).
    pub(super) inline: bool,
    /// What the key used (its task's polls and inline calls' move it).
    cpu: Arc<CpuMeter>,
    /// The key's `cpu_budget`; `None` for a whole core.
    budget: Option<CpuBudget>,
    /// The node's scheduler, the key's place in it, and its tenant.
    scheduler: Arc<Scheduler>,
    seat: Arc<Seat>,
    tenant: Arc<str>,
    /// Why the host interrupted the guest, when it did (CPU or memory limit).
    pub(super) death: Option<String>,
    pub(crate) timers: HashMap<u64, AbortHandle>,
    pub(crate) next_timer: u64,
    /// Each subscribed topic, with the host bytes it holds.
    pub(crate) subscriptions: BTreeMap<String, Held>,
    /// The key's publish rate limit (`max_publishes_per_second`).
    pub(crate) publishes: PublishBucket,
    /// The key's durable state and the output gate ([`KeyStorage`]).
    pub(crate) storage: KeyStorage,
    /// Whether the module exports `fief:key/alarm-handler` (only then may
    /// it set alarms).
    pub(crate) alarms_allowed: bool,
    /// The trace of the message being handled (a call's or a cast's), set
    /// for its callback only: the key's calls and casts carry it, and its
    /// log lines name it (`crate::trace`).
    pub(crate) trace: Option<TraceContext>,
}

impl WasiView for KeyCtx {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        let log = &self.log;
        WasiCtxView {
            ctx: self
                .wasi
                .get_or_insert_with(|| crate::sandbox::plain_wasi_ctx(log)),
            table: &mut self.table,
        }
    }
}

impl Drop for KeyCtx {
    fn drop(&mut self) {
        for (_, timer) in self.timers.drain() {
            timer.abort();
        }
        if let Some(services) = self.env.services.upgrade() {
            for topic in std::mem::take(&mut self.subscriptions).into_keys() {
                services.pubsub.unsubscribe(
                    &topic,
                    &self.env.module,
                    &self.env.key,
                    self.env.generation,
                );
            }
        }
    }
}

impl KeyCtx {
    /// The side-effect gate: every host import that has an effect calls this
    /// first. After a kill, or after the node's fence point for a `terminate`
    /// key, the import is refused with a trap, so the guest runs no further.
    pub(crate) fn gate(&self) -> wasmtime::Result<Arc<KeyServices>> {
        if self.env.control.is_killed() {
            wasmtime::bail!("effect refused: this key process was killed");
        }
        let Some(services) = self.env.services.upgrade() else {
            wasmtime::bail!("effect refused: the node has stopped");
        };
        if self.env.on_fence == OnFence::Terminate && !services.may_act() {
            wasmtime::bail!("effect refused: the node is fenced");
        }
        Ok(services)
    }

    /// The gate, for an import that asks the node itself (a call, a cast, a
    /// cache operation): also the node, which a key reaches only as
    /// [`KeyNode`]. Refused, as the gate is, once the node has stopped.
    pub(crate) fn gate_node(&self) -> wasmtime::Result<(Arc<KeyServices>, Arc<dyn KeyNode>)> {
        let services = self.gate()?;
        let Some(node) = services.node() else {
            wasmtime::bail!("effect refused: the node has stopped");
        };
        Ok((services, node))
    }

    /// Charge `spent`, host time of an import working for the guest, and
    /// the copying of `lifted` bytes of arguments out of its memory (done
    /// before the import runs, so estimated at [`LIFT_BYTES_PER_NANO`]) to
    /// the callback's CPU budget; past `cpu_limit` the guest traps with the
    /// CPU-limit death, as if its own code had run that long.
    pub(crate) fn charge_host(&mut self, spent: Duration, lifted: usize) -> wasmtime::Result<()> {
        let nanos = u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX);
        if self.absorb_host_nanos(nanos.saturating_add(lifted as u64 / LIFT_BYTES_PER_NANO)) {
            let death = self.cpu_limit_death();
            self.death = Some(death.clone());
            wasmtime::bail!(death);
        }
        Ok(())
    }

    /// Add `nanos` and the logger's host time to the callback's ticks;
    /// whether it is now over its budget.
    fn absorb_host_nanos(&mut self, nanos: u64) -> bool {
        let nanos = nanos.saturating_add(self.log.take_host_nanos());
        self.host_nanos = self.host_nanos.saturating_add(nanos);
        self.cpu_ticks = self
            .cpu_ticks
            .saturating_add(self.host_nanos / self.tick_nanos);
        self.host_nanos %= self.tick_nanos;
        self.cpu_ticks > self.cpu_limit_ticks
    }

    /// What a yielding callback waits for before its next slice: the end
    /// of its throttling if it is over its `cpu_budget`, then its turn.
    fn next_slice(&mut self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let (scheduler, seat, tenant) = (
            self.scheduler.clone(),
            self.seat.clone(),
            self.tenant.clone(),
        );
        match self.throttle() {
            None => Box::pin(scheduler.next_turn(&tenant, &seat)),
            Some(wait) => {
                scheduler.release(&seat);
                let cpu = self.cpu.clone();
                Box::pin(async move {
                    cpu.sit_out(wait).await;
                    scheduler.next_turn(&tenant, &seat).await;
                })
            }
        }
    }

    /// How long the key must wait for its `cpu_budget` and its tenant's
    /// `cpu_budget_per_tenant` before it runs again, if it is over either.
    fn throttle(&mut self) -> Option<Duration> {
        if self.budget.is_none() && !self.cpu.tenant().has_budget() {
            // The common case, on every warm call: no clock read.
            return None;
        }
        let now = std::time::Instant::now();
        let own = self
            .budget
            .as_mut()
            .and_then(|budget| budget.wait(self.cpu.used_nanos(), now));
        let tenant = self.cpu.tenant().wait(now);
        own.max(tenant)
    }

    fn cpu_limit_death(&self) -> String {
        format!(
            "CPU limit exceeded: the callback ran for more than {} epoch ticks (cpu_limit), its \
             time in host imports included",
            self.cpu_limit_ticks
        )
    }
}

/// Bytes of import arguments (strings, lists) the host is taken to copy out
/// of a guest's memory per nanosecond (about 2 GB/s, a conservative figure
/// for a copy and a UTF-8 check), charged to the callback as host time.
const LIFT_BYTES_PER_NANO: u64 = 2;

/// Why a key process ended abnormally.
#[derive(Debug)]
pub(super) struct Death(pub(super) String);

/// What the caller of a callback that ended its process is told: a commit
/// that failed is the store's unavailability (the call may be retried),
/// anything else the key's death.
pub(super) fn caller_error(why: String) -> Error {
    if why.starts_with(super::storage::COMMIT_FAILED) {
        Error::StorageUnavailable(why)
    } else {
        Error::KeyDied(why)
    }
}

/// The functions of a module's `connection-handler` export, in one
/// instance.
#[derive(Clone, Copy)]
struct ConnectionFuncs {
    opened: wasmtime::component::Func,
    text: wasmtime::component::Func,
    binary: wasmtime::component::Func,
    closed: wasmtime::component::Func,
}

/// A running key process: a store and the instance in it.
pub(super) struct KeyProcess {
    pub(super) store: Store<KeyCtx>,
    guest: KeyModule,
    /// `alarm-handler.handle-alarm`, if the module exports it.
    alarm_handler: Option<wasmtime::component::Func>,
    /// `connection-handler`'s functions, if the module exports them.
    connection_handler: Option<ConnectionFuncs>,
    /// The key's CPU meter (the key's task and inline calls move it).
    pub(super) cpu: Arc<CpuMeter>,
}

impl KeyProcess {
    /// Instantiate `module` for a key and run its `init`; `inline`: on a
    /// caller's task, where `init`'s first epoch tick demotes the activation
    /// to the key's task (see `inline.rs`, `run_activation`).
    pub(super) async fn start(
        services: &KeyServices,
        module: &CompiledModule,
        env: Arc<KeyEnv>,
        handoff: Option<&[u8]>,
        (cpu, seat): (Arc<CpuMeter>, Arc<Seat>),
        inline: bool,
    ) -> Result<Self> {
        let options = &module.options;
        let log = Arc::new(GuestLogger::new(
            env.module.clone(),
            env.key.clone(),
            LogLimits {
                lines_per_second: options.max_log_lines_per_second,
                bytes_per_second: options.max_log_bytes_per_second.as_u64(),
            },
            services.metrics.guest_log_counters(&env.module),
        ));
        let wasi = crate::sandbox::wasi_ctx(options, &log)?;
        let memory_limit = options.memory_limit.as_u64() as usize;
        let limits = wasmtime::StoreLimitsBuilder::new()
            .memory_size(memory_limit)
            .table_elements(MAX_TABLE_ELEMENTS)
            .instances(64)
            .trap_on_grow_failure(true)
            .build();
        let tick = services.config.epoch_tick.as_nanos().max(1);
        let cpu_limit_ticks = (options.cpu_limit.as_nanos() / tick).max(1) as u64;
        let tenant: Arc<str> = Arc::from(crate::auth::tenant_of(&env.module).unwrap_or(""));
        let ctx = KeyCtx {
            wasi,
            table: crate::sandbox::resource_table(),
            limits: super::linear_memory::KeyLimiter::new(limits, services.guest_memory.clone()),
            memory_limit,
            env: env.clone(),
            cpu_ticks: 0,
            cpu_limit_ticks,
            tick_nanos: u64::try_from(tick).unwrap_or(u64::MAX),
            host_nanos: 0,
            log,
            resuming: false,
            inline,
            cpu: cpu.clone(),
            budget: CpuBudget::for_key(
                options.cpu_budget,
                options.cpu_budget_window,
                std::time::Instant::now(),
            ),
            scheduler: services.runtime.scheduler.clone(),
            seat,
            tenant,
            death: None,
            timers: HashMap::new(),
            next_timer: 1,
            subscriptions: BTreeMap::new(),
            publishes: PublishBucket::new(options.max_publishes_per_second, services.clock.now()),
            storage: KeyStorage::new(
                services.storage.clone(),
                crate::storage::KeyScope {
                    module: env.module.to_string(),
                    key: env.key.to_string(),
                },
                crate::storage::Fence {
                    partition: env.partition.0,
                    token: env.token.0,
                },
                crate::storage::state::StorageLimits {
                    max_value: options.max_storage_value_size.as_u64(),
                    max_bytes_per_key: options.max_storage_bytes_per_key.as_u64(),
                    max_bytes_per_tenant: services.config.max_storage_bytes_per_tenant.as_u64(),
                    max_writes_per_callback: options.max_storage_writes_per_callback,
                    max_alarms: options.max_alarms_per_key,
                },
                env.mailbox.ledger().clone(),
                module.uses_storage,
            ),
            alarms_allowed: module.alarm_handler.is_some(),
            trace: None,
        };
        let mut store = Store::new(&services.runtime.engine, ctx);
        store.limiter(|ctx| &mut ctx.limits);
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(|mut store| {
            let ctx = store.data_mut();
            if ctx.env.control.is_killed() {
                return Ok(UpdateDeadline::Interrupt);
            }
            // Past the fence point a `terminate` key runs no guest code,
            // whether or not the fence sweep has flagged it yet: the next
            // epoch tick (or the fence's own epoch bump) interrupts it. This
            // makes "nothing runs" independent of how many keys are live.
            if ctx.env.on_fence == OnFence::Terminate
                && ctx
                    .env
                    .services
                    .upgrade()
                    .is_none_or(|services| !services.may_act())
            {
                ctx.env.control.kill_one_of_many(super::FENCED);
                return Ok(UpdateDeadline::Interrupt);
            }
            // The first check after a yield: the kill flag was read just
            // above, after the guest resumed; its ticks count from here.
            let resumed = std::mem::take(&mut ctx.resuming);
            if !resumed {
                ctx.cpu_ticks += 1;
            }
            // Host time spent writing its stdout and stderr is the
            // callback's too.
            if ctx.absorb_host_nanos(0) {
                ctx.death = Some(ctx.cpu_limit_death());
                return Ok(UpdateDeadline::Interrupt);
            }
            if resumed {
                return Ok(UpdateDeadline::Continue(1));
            }
            // An inline call that began less than half a tick before this
            // tick has not used its slice: it runs on to the next tick (so
            // it holds its caller's worker under one and a half ticks). A
            // call of microseconds that straddled a tick was demoted, and
            // waited for a guest thread behind long callbacks.
            if ctx.inline
                && crate::cpu_budget::poll_running_for()
                    .is_some_and(|ran| ran.as_nanos() < u128::from(ctx.tick_nanos / 2))
            {
                return Ok(UpdateDeadline::Continue(1));
            }
            // Let other keys run. The deadline after the yield is the epoch
            // at resumption (delta 0), so the guest's first check after it
            // resumes calls back and reads the kill flag again: a kill (and
            // its epoch bump) that lands while the key waits to be resumed
            // is not absorbed into the new deadline.
            ctx.resuming = true;
            if std::mem::take(&mut ctx.inline) {
                // Its first slice is used on a caller's task: the caller
                // hands it to the key's task (`InlineCall`), where it waits
                // for its turn with the other long callbacks.
                ctx.env.control.demote.store(true, Ordering::SeqCst);
                return Ok(UpdateDeadline::Yield(0));
            }
            Ok(UpdateDeadline::YieldCustom(0, ctx.next_slice()))
        });
        let instance = match module
            .pre
            .instance_pre()
            .instantiate_async(&mut store)
            .await
        {
            Ok(instance) => instance,
            Err(e) => {
                // Pool exhaustion is the node being full, not the key dying:
                // a 429 the caller may retry, naming the pool that ran out.
                if let Some(full) = e
                    .chain()
                    .find_map(|c| c.downcast_ref::<wasmtime::PoolConcurrencyLimitError>())
                {
                    return Err(Error::PoolFull {
                        module: env.module.to_string(),
                        detail: full.to_string(),
                    });
                }
                let why = describe_failure(&mut store, &e);
                return Err(Error::KeyDied(format!("instantiation failed: {why}")));
            }
        };
        let guest = module
            .exports
            .load(&mut store, &instance)
            .map_err(|e| Error::KeyDied(format!("instantiation failed: {e:#}")))?;
        let alarm_handler = module
            .alarm_handler
            .as_ref()
            .and_then(|index| instance.get_func(&mut store, index));
        let connection_handler = module.connection_handler.and_then(|h| {
            Some(ConnectionFuncs {
                opened: instance.get_func(&mut store, h.opened)?,
                text: instance.get_func(&mut store, h.text)?,
                binary: instance.get_func(&mut store, h.binary)?,
                closed: instance.get_func(&mut store, h.closed)?,
            })
        });
        let mut process = KeyProcess {
            store,
            guest,
            alarm_handler,
            connection_handler,
            cpu,
        };
        process.store.data_mut().storage.preload().await;
        process.begin_callback();
        let init = process
            .guest
            .fief_key_lifecycle()
            .call_init(&mut process.store, &env.key, handoff)
            .await;
        match process.settle(init).await {
            Ok(Ok(())) => Ok(process),
            // Guest text is cut where it enters the host: the refusal goes
            // to the caller, the log and peers.
            Ok(Err(refusal)) => Err(Error::InitRefused(bounded(refusal, MAX_GUEST_ERROR))),
            Err(Death(why)) => Err(caller_error(why)),
        }
    }

    /// A callback returned `result`: give back its turn, then commit its
    /// writes and let out the outputs that waited for them (the output
    /// gate, [`KeyStorage`]). A trap, or a commit that failed, is the
    /// process's death; then nothing that waited leaves.
    async fn settle<T>(&mut self, result: wasmtime::Result<T>) -> Result<T, Death> {
        self.end_callback();
        let value = result.map_err(|e| self.death(&e))?;
        let control = self.store.data().env.control.clone();
        let outputs = self
            .store
            .data_mut()
            .storage
            .commit(&control)
            .await
            .map_err(Death)?;
        self.store.data_mut().release(outputs);
        Ok(value)
    }

    /// The callback ended: give back its turn, if it holds one.
    fn end_callback(&mut self) {
        let ctx = self.store.data();
        ctx.scheduler.release(&ctx.seat);
    }

    /// How long the key must wait for its `cpu_budget` before its next
    /// callback, if it is over it.
    pub(super) fn throttle(&mut self) -> Option<Duration> {
        self.store.data_mut().throttle()
    }

    fn begin_callback(&mut self) {
        let ctx = self.store.data_mut();
        ctx.storage.begin_callback();
        ctx.cpu_ticks = 0;
        ctx.host_nanos = 0;
        ctx.log.take_host_nanos();
        ctx.resuming = false;
        self.set_trace(None);
        self.store.set_epoch_deadline(1);
    }

    /// The trace of the callback about to run (none but a call's or a
    /// cast's): its log lines and its calls carry it.
    fn set_trace(&mut self, trace: Option<TraceContext>) {
        let ctx = self.store.data_mut();
        // The logger's copy is only ever set here: unchanged (no trace, call
        // after call), it is not locked for (two locks per warm call).
        if ctx.trace != trace {
            ctx.trace = trace;
            ctx.log.set_trace(trace);
        }
    }

    fn death(&mut self, error: &wasmtime::Error) -> Death {
        Death(describe_failure(&mut self.store, error))
    }

    pub(super) async fn handle_call(
        &mut self,
        message: &[u8],
        trace: Option<TraceContext>,
    ) -> Result<Result<Vec<u8>, String>, Death> {
        self.store.data_mut().storage.preload().await;
        self.begin_callback();
        self.set_trace(trace);
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handle_call(&mut self.store, message)
            .await;
        // The guest's error is cut where it enters the host: it travels to
        // the caller (and on to HTTP, logs and peers) like a reply.
        self.settle(r)
            .await
            .map(|result| result.map_err(|why| bounded(why, MAX_GUEST_ERROR)))
    }

    pub(super) async fn handle_cast(
        &mut self,
        message: &[u8],
        trace: Option<TraceContext>,
    ) -> Result<(), Death> {
        self.store.data_mut().storage.preload().await;
        self.begin_callback();
        self.set_trace(trace);
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handle_cast(&mut self.store, message)
            .await;
        self.settle(r).await
    }

    pub(super) async fn handle_info(&mut self, info: &Info) -> Result<(), Death> {
        if let Info::Timer(TimerFired { id, .. }) = info {
            // A timer cancelled after it fired but before it was delivered
            // is not delivered.
            if self.store.data_mut().timers.remove(id).is_none() {
                return Ok(());
            }
        }
        self.store.data_mut().storage.preload().await;
        self.begin_callback();
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handle_info(&mut self.store, info)
            .await;
        self.settle(r).await
    }

    /// Run the alarm handler for alarm `name` due at `at_ms`, if the key
    /// still holds that alarm at that time (otherwise its own view wins:
    /// `Superseded`). The callback's commit deletes the alarm as its first
    /// write. A trap or a failed commit is the process's death, as for any
    /// callback; the caller reports it as `Trapped` or `CommitRefused`.
    pub(super) async fn handle_alarm(
        &mut self,
        name: &str,
        at_ms: u64,
        attempt: u32,
    ) -> Result<FireOutcome, Death> {
        self.store.data_mut().storage.preload().await;
        let Some(func) = self.alarm_handler else {
            // Redeployed without a handler: retried (with backoff) until a
            // version that has one runs the key.
            return Ok(FireOutcome::NotRun);
        };
        let Ok(state) = self.store.data_mut().storage.state() else {
            // The state could not be loaded (the store is unreachable).
            return Ok(FireOutcome::NotRun);
        };
        if let Err(at_ms) = state.begin_firing(name, at_ms) {
            return Ok(FireOutcome::Superseded { at_ms });
        }
        self.store.data_mut().storage.recharge();
        self.begin_callback();
        let r = match func.typed::<(&str, u32), ()>(&self.store) {
            Ok(typed) => typed.call_async(&mut self.store, (name, attempt)).await,
            Err(e) => Err(e),
        };
        self.settle(r).await.map(|()| FireOutcome::Committed)
    }

    /// Tell the guest what happened to one of its connections (a module
    /// without `connection-handler` takes none: nothing to tell).
    pub(super) async fn handle_connection(&mut self, event: &ConnEvent) -> Result<(), Death> {
        let Some(funcs) = self.connection_handler else {
            return Ok(());
        };
        self.store.data_mut().storage.preload().await;
        self.begin_callback();
        let store = &mut self.store;
        let r = match event {
            ConnEvent::Opened { id, resumed, .. } => {
                match funcs.opened.typed::<(u64, bool), ()>(&*store) {
                    Ok(f) => f.call_async(&mut *store, (*id, *resumed)).await,
                    Err(e) => Err(e),
                }
            }
            ConnEvent::Text { id, text } => match funcs.text.typed::<(u64, &str), ()>(&*store) {
                Ok(f) => f.call_async(&mut *store, (*id, text.as_str())).await,
                Err(e) => Err(e),
            },
            ConnEvent::Binary { id, data } => match funcs.binary.typed::<(u64, &[u8]), ()>(&*store)
            {
                Ok(f) => f.call_async(&mut *store, (*id, data.as_slice())).await,
                Err(e) => Err(e),
            },
            ConnEvent::Closed { id, code, reason } => {
                match funcs.closed.typed::<(u64, u16, &str), ()>(&*store) {
                    Ok(f) => {
                        f.call_async(&mut *store, (*id, *code, reason.as_str()))
                            .await
                    }
                    Err(e) => Err(e),
                }
            }
        };
        self.settle(r).await
    }

    pub(super) async fn handle_fence(
        &mut self,
        deadline: Duration,
    ) -> Result<FenceDecision, Death> {
        self.begin_callback();
        let deadline_ms = u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX);
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handle_fence(&mut self.store, deadline_ms)
            .await;
        self.settle(r).await.map(|decision| match decision {
            FenceDecision::Stop(reason) => FenceDecision::Stop(bounded(reason, MAX_GUEST_ERROR)),
            other => other,
        })
    }

    pub(super) async fn handoff(&mut self) -> Result<Option<Vec<u8>>, Death> {
        self.begin_callback();
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handoff(&mut self.store)
            .await;
        self.settle(r).await
    }

    pub(super) async fn terminate(&mut self, reason: &StopReason) -> Result<(), Death> {
        self.begin_callback();
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_terminate(&mut self.store, reason)
            .await;
        self.settle(r).await
    }

    pub(super) fn timers_armed(&self) -> usize {
        self.store.data().timers.len()
    }
}

/// Say why a guest invocation failed, most specific cause first, in at
/// most [`MAX_GUEST_ERROR`] bytes (a trap's text may carry the guest's).
fn describe_failure(store: &mut Store<KeyCtx>, error: &wasmtime::Error) -> String {
    bounded(describe_failure_in_full(store, error), MAX_GUEST_ERROR)
}

fn describe_failure_in_full(store: &mut Store<KeyCtx>, error: &wasmtime::Error) -> String {
    let ctx = store.data_mut();
    if let Some(reason) = ctx.env.control.reason() {
        return format!("killed: {reason}");
    }
    if let Some(death) = ctx.death.take() {
        return death;
    }
    let text = format!("{error:#}");
    if text.contains("forcing trap when growing table") || text.contains("table element") {
        return format!(
            "table limit exceeded: the key grew a table past its bound (at most \
             {MAX_TABLE_ELEMENTS} elements, or the pool's table size if smaller): {}",
            first_line(&error.root_cause().to_string())
        );
    }
    if text.contains("exceeds the limit") || text.contains("forcing trap when growing memory") {
        return format!(
            "memory limit exceeded: the key tried to grow its memory past memory_limit ({} bytes)",
            ctx.memory_limit
        );
    }
    // The root cause is what went wrong (a trap code, or the host's own
    // refusal, e.g. the side-effect gate's); the outer layers only say where.
    let cause = error.root_cause().to_string();
    match error.downcast_ref::<Trap>() {
        Some(Trap::StackOverflow) => "stack overflow (unbounded recursion?)".to_owned(),
        Some(trap) => format!("trapped: {trap}"),
        None => first_line(&cause).to_owned(),
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or(text)
}

/// Arm a one-shot timer for the key whose store data is `ctx`; returns its
/// id, or the refusal if its tag would pass the key's (or its tenant's)
/// host-memory budget.
///
/// The timer is a task that puts a timer info in the key's mailbox; it is
/// aborted when the key's store is dropped. Its tag's bytes are charged
/// while it is armed and travel with the info into the mailbox.
pub(crate) fn arm_timer(
    ctx: &mut KeyCtx,
    delay: Duration,
    tag: Vec<u8>,
) -> std::result::Result<u64, crate::host_bytes::Refusal> {
    let (id, held) = reserve_timer(ctx, &tag)?;
    spawn_timer(ctx, id, delay, tag, held);
    Ok(id)
}

/// Charge a timer's tag and give it its id, without arming it (the output
/// gate arms it later with [`spawn_timer`]).
pub(crate) fn reserve_timer(
    ctx: &mut KeyCtx,
    tag: &[u8],
) -> std::result::Result<(u64, Held), crate::host_bytes::Refusal> {
    let held = ctx
        .env
        .mailbox
        .ledger()
        .hold(crate::host_bytes::TIMER_OVERHEAD + tag.len())?;
    let id = ctx.next_timer;
    ctx.next_timer += 1;
    Ok((id, held))
}

/// Arm timer `id`, reserved with [`reserve_timer`].
pub(crate) fn spawn_timer(ctx: &mut KeyCtx, id: u64, delay: Duration, tag: Vec<u8>, held: Held) {
    let mailbox = ctx.env.mailbox.clone();
    let log = ctx.log.clone();
    let task = tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let Some(tx) = mailbox.upgrade() else { return };
        let fired = Envelope::Info(Info::Timer(TimerFired { id, tag }));
        if tx.try_send_held(fired, held).is_err() {
            log.host_warning(format_args!(
                "timer {id} dropped: the key's mailbox is full"
            ));
        }
    });
    ctx.timers.insert(id, task.abort_handle());
}
