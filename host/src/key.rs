//! Key processes: one component instance per live key, in its own store,
//! driven by one task that takes messages from a bounded mailbox one at a time.
//!
//! This module owns a key's life: activation on the first message
//! ([`ModuleSlot::deliver`]), the message loop (calls, casts, timer and pub/sub
//! infos, graceful stops, in arrival order), the idle timeout, and death. A key
//! dies when its guest traps, when it overruns its CPU budget, when it grows
//! past its memory limit, or when the host kills it. The kill path (contract
//! §2): set the key's kill flag, bump the engine's epoch so running guest code
//! traps at its next check, and drop the store — a poisoned instance is never
//! entered again. A dead key's timers are cancelled and its subscriptions
//! removed when its store is dropped, so nothing it armed fires afterwards.
//!
//! Single ownership on one node: a key has at most one entry in its module's
//! table, and the entry is removed only by the key's own task after its store
//! has been dropped, so a fresh process for the key can only start once the
//! old one is gone.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::{Duration, SystemTime};

use fief_core::{OnFence, OwnershipToken, PartitionId};
use tokio::sync::futures::Notified;
use tokio::sync::{Notify, oneshot};
use tokio::task::AbortHandle;
use wasmtime::component::ResourceTable;
use wasmtime::{Store, StoreLimits, Trap, UpdateDeadline};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::bindings::KeyModule;
use crate::bindings::types::{FenceDecision, Info, StopReason, TimerFired};
use crate::cpu_budget::{CpuBudget, CpuMeter, poll_metered};
use crate::error::{Error, Result};
use crate::guest_log::{GuestLogger, LogLimits, MAX_GUEST_ERROR, bounded};
use crate::host_bytes::{Held, Ledger};
use crate::limbo::{Limbo, LimboEntry, Survivor, mode_name};
use crate::mailbox::{self, Mailbox, MailboxRx, Refused, WeakMailbox};
use crate::module::CompiledModule;
use crate::node::NodeShared;
use crate::sandbox::PublishBucket;
use crate::scheduler::{Scheduler, Seat};

/// Most elements one table of a key may grow to (`table.grow` past it traps
/// the key); the pool's per-table slot may be smaller.
const MAX_TABLE_ELEMENTS: usize = 100_000;

/// Lock a std mutex, ignoring poisoning: every critical section here leaves
/// the data consistent before it can panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The kill switch of one key process.
///
/// The key's task learns of a kill or a fence order through `changed`, which
/// is notified with `notify_waiters`: the task keeps one registered waiter
/// for its whole life and reads the flags (atomics) when it fires, so a
/// message costs no waiter registration and no lock here.
pub(crate) struct KeyControl {
    killed: AtomicBool,
    reason: Mutex<Option<String>>,
    /// Notified when `killed` or `fence_order` is set.
    changed: Notify,
    /// Set at the fence for `continue`/`callback` keys: the process lives on
    /// in limbo and takes no routed message again.
    survivor: AtomicBool,
    /// A pending `handle-fence` order (callback mode): its deadline.
    fence_order: Mutex<Option<Duration>>,
    /// Whether `fence_order` holds an order (read without the lock).
    fence_ordered: AtomicBool,
    /// Set once `handle-fence` returned.
    fence_answered: AtomicBool,
    /// Set by the key's task once its store has been dropped.
    exited: tokio::sync::watch::Sender<bool>,
    /// Set by the key's task from just before it takes a message out of its
    /// mailbox until it has processed it: while set, a caller does not run a
    /// call inline (it would overtake that message).
    receiving: AtomicBool,
    /// An inline call whose caller went away before it finished: the key's
    /// task finishes it (a half-run call must not be dropped, that would
    /// poison the instance).
    orphan: Mutex<Option<Orphan>>,
    has_orphan: AtomicBool,
    /// Why the process died during an inline call (its store is dropped).
    death: Mutex<Option<String>>,
    /// Inline calls so far (the idle timeout counts them as messages).
    inline_calls: AtomicU64,
    /// Set by the epoch callback when an inline call used its first slice:
    /// its caller hands it to the key's task (see [`InlineCall`]).
    demote: AtomicBool,
}

impl Default for KeyControl {
    fn default() -> Self {
        KeyControl {
            killed: AtomicBool::new(false),
            reason: Mutex::new(None),
            changed: Notify::new(),
            survivor: AtomicBool::new(false),
            fence_order: Mutex::new(None),
            fence_ordered: AtomicBool::new(false),
            fence_answered: AtomicBool::new(false),
            exited: tokio::sync::watch::channel(false).0,
            receiving: AtomicBool::new(false),
            orphan: Mutex::new(None),
            has_orphan: AtomicBool::new(false),
            death: Mutex::new(None),
            inline_calls: AtomicU64::new(0),
            demote: AtomicBool::new(false),
        }
    }
}

impl KeyControl {
    /// Make the key a survivor; for a callback key, also order it to run
    /// `handle-fence` with `deadline`.
    pub(crate) fn fence(&self, callback_deadline: Option<Duration>) {
        self.survivor.store(true, Ordering::SeqCst);
        if let Some(deadline) = callback_deadline {
            *lock(&self.fence_order) = Some(deadline);
            self.fence_ordered.store(true, Ordering::SeqCst);
            self.changed.notify_waiters();
        }
    }

    pub(crate) fn is_survivor(&self) -> bool {
        self.survivor.load(Ordering::SeqCst)
    }

    /// Take the deadline of a pending `handle-fence` order, if any.
    fn take_fence_order(&self) -> Option<Duration> {
        if !self.fence_ordered.load(Ordering::SeqCst) {
            return None;
        }
        let order = lock(&self.fence_order).take();
        self.fence_ordered.store(false, Ordering::SeqCst);
        order
    }

    /// Resolves once the key's store has been dropped.
    pub(crate) async fn exited(&self) {
        let mut rx = self.exited.subscribe();
        let _ = rx.wait_for(|exited| *exited).await;
    }
    /// Set the kill flag. The caller bumps the engine epoch afterwards so a
    /// running guest notices at once. Returns false if it was already killed.
    pub(crate) fn kill(&self, reason: &str) -> bool {
        let mut slot = lock(&self.reason);
        if self.killed.swap(true, Ordering::SeqCst) {
            return false;
        }
        *slot = Some(reason.to_owned());
        drop(slot);
        self.changed.notify_waiters();
        true
    }

    pub(crate) fn is_killed(&self) -> bool {
        self.killed.load(Ordering::SeqCst)
    }

    fn reason(&self) -> Option<String> {
        lock(&self.reason).clone()
    }

    /// Resolves once the key is killed.
    async fn killed(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.is_killed() {
                return;
            }
            changed.await;
        }
    }

    /// Resolves once the key is killed, re-arming `changed` (the task's
    /// registered waiter) each time it fires.
    async fn killed_with<'a>(&'a self, changed: &mut Pin<&mut Notified<'a>>) {
        while !self.is_killed() {
            changed.as_mut().await;
            rearm(self, changed);
        }
    }

    /// Hand a half-run inline call to the key's task.
    fn adopt(&self, orphan: Orphan) {
        *lock(&self.orphan) = Some(orphan);
        self.has_orphan.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    fn take_orphan(&self) -> Option<Orphan> {
        if !self.has_orphan.load(Ordering::SeqCst) {
            return None;
        }
        self.has_orphan.store(false, Ordering::SeqCst);
        lock(&self.orphan).take()
    }

    /// The process died during an inline call (its store is dropped).
    fn died(&self, why: String) {
        lock(&self.death).get_or_insert(why);
        self.changed.notify_waiters();
    }

    fn death(&self) -> Option<String> {
        lock(&self.death).clone()
    }

    /// Count an inline call (for the idle timeout).
    fn touch(&self) {
        self.inline_calls.fetch_add(1, Ordering::Relaxed);
    }

    fn inline_calls(&self) -> u64 {
        self.inline_calls.load(Ordering::Relaxed)
    }
}

/// A key's process, shared by its task and by callers that run a call
/// inline while the key is idle. Whoever holds the lock may run guest code;
/// `None` once the store has been dropped (or before it is created).
type ProcessCell = tokio::sync::Mutex<Option<KeyProcess>>;

/// The key's process, held (by its task or an inline caller).
type ProcessGuard = tokio::sync::OwnedMutexGuard<Option<KeyProcess>>;

/// An inline call in flight, boxed so that it can move to the key's task if
/// its caller goes away.
type InlineFuture = Pin<Box<dyn Future<Output = Result<Vec<u8>>> + Send>>;

/// A half-run inline call handed to the key's task, with where its reply
/// goes (`None`: its caller went away).
struct Orphan {
    call: InlineFuture,
    reply: Option<oneshot::Sender<Result<Vec<u8>>>>,
}

impl Orphan {
    /// Finish the call; its reply, unless it is to wait until the process's
    /// end is settled (the call killed the process: its caller must not
    /// retry before the key can start afresh).
    async fn finish(
        self,
        control: &KeyControl,
    ) -> Option<(oneshot::Sender<Result<Vec<u8>>>, Result<Vec<u8>>)> {
        let outcome = self.call.await;
        let reply = self.reply?;
        if control.death().is_some() || control.is_killed() {
            return Some((reply, outcome));
        }
        let _ = reply.send(outcome);
        None
    }
}

/// An inline call, as its caller polls it. Dropped before it finished (the
/// caller timed out or went away), it hands the call to the key's task,
/// which finishes it: the key never sees a call cut in half.
///
/// It also hands the call to the key's task when the call is *demoted*:
/// still running at its first epoch tick, it continues on the guest threads
/// (`crate::scheduler`) while the caller waits for its reply, so a long
/// callback never holds the caller's worker (an API or peer-link worker)
/// for more than one slice.
struct InlineCall {
    future: Option<InlineFuture>,
    control: Arc<KeyControl>,
    /// The key's CPU meter: the caller's polls are the key's time too.
    cpu: Arc<CpuMeter>,
    /// The reply of a demoted call, from the key's task.
    demoted: Option<oneshot::Receiver<Result<Vec<u8>>>>,
}

impl InlineCall {
    fn new(future: InlineFuture, control: Arc<KeyControl>, cpu: Arc<CpuMeter>) -> Self {
        InlineCall {
            future: Some(future),
            control,
            cpu,
            demoted: None,
        }
    }
}

impl Future for InlineCall {
    type Output = Result<Vec<u8>>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = &mut *self;
        if let Some(future) = this.future.as_mut() {
            let poll = poll_metered(&this.cpu, future.as_mut(), cx);
            if poll.is_ready() {
                self.future = None;
                return poll;
            }
            if !self.control.demote.swap(false, Ordering::SeqCst) {
                return Poll::Pending;
            }
            // The epoch callback yielded at the first tick: let the key's
            // task finish the call, and wait for its reply.
            let call = self.future.take().expect("checked above");
            let (reply, demoted) = oneshot::channel();
            self.control.adopt(Orphan {
                call,
                reply: Some(reply),
            });
            self.demoted = Some(demoted);
        }
        let demoted = self.demoted.as_mut().expect("polled after it finished");
        Pin::new(demoted).poll(cx).map(|reply| {
            reply.unwrap_or_else(|_| Err(Error::KeyDied("the key process went away".to_owned())))
        })
    }
}

impl Drop for InlineCall {
    fn drop(&mut self) {
        if let Some(call) = self.future.take() {
            self.control.adopt(Orphan { call, reply: None });
        }
    }
}

/// Run `handle-call` on the caller's task, holding the key's process.
async fn run_inline(
    mut process: ProcessGuard,
    control: Arc<KeyControl>,
    message: Vec<u8>,
) -> Result<Vec<u8>> {
    let Some(running) = process.as_mut() else {
        return Err(Error::KeyDied("the key process went away".to_owned()));
    };
    // Its first yield demotes it to the key's task (see `InlineCall`).
    control.demote.store(false, Ordering::SeqCst);
    running.store.data_mut().inline = true;
    // The guest traps at its next epoch check once killed; a kill while it
    // waits on the host (e.g. a host call) ends the call here.
    let outcome = {
        let call = running.handle_call(&message);
        tokio::pin!(call);
        tokio::select! {
            biased;
            outcome = &mut call => Some(outcome),
            () = control.killed() => None,
        }
    };
    if let Some(running) = process.as_mut() {
        running.store.data_mut().inline = false;
    }
    match outcome {
        Some(Ok(result)) => result.map_err(Error::Rejected),
        Some(Err(Death(why))) => {
            *process = None;
            control.died(why.clone());
            Err(Error::KeyDied(why))
        }
        None => {
            *process = None;
            let why = format!("killed: {}", control.reason().unwrap_or_default());
            control.died(why.clone());
            Err(Error::KeyDied(why))
        }
    }
}

/// Register a fresh waiter for `control`'s changes in `changed` (after the
/// previous one fired). Check the flags after this, not before.
fn rearm<'a>(control: &'a KeyControl, changed: &mut Pin<&mut Notified<'a>>) {
    changed.set(control.changed.notified());
    changed.as_mut().enable();
}

/// A message for a key process.
pub(crate) enum Envelope {
    /// A request; the reply goes back on `reply`.
    Call {
        message: Vec<u8>,
        reply: oneshot::Sender<Result<Vec<u8>>>,
        via: Via,
    },
    /// A one-way message.
    Cast { message: Vec<u8> },
    /// A timer fired or a publication arrived.
    Info(Info),
    /// Stop gracefully: `handoff` first if asked, then `terminate(reason)`.
    Stop {
        reason: StopReason,
        reply: oneshot::Sender<Result<Option<Vec<u8>>>>,
    },
}

impl Envelope {
    /// Whether the message came through routing (not a timer, a
    /// publication, a stop or a local handle).
    fn is_routed(&self) -> bool {
        matches!(
            self,
            Envelope::Call {
                via: Via::Routed,
                ..
            } | Envelope::Cast { .. }
        )
    }

    /// The bytes of payload it makes the host hold while it waits in a
    /// mailbox (charged to the key's host-memory ledger).
    pub(crate) fn payload_bytes(&self) -> usize {
        crate::host_bytes::MESSAGE_OVERHEAD
            + match self {
                Envelope::Call { message, .. } | Envelope::Cast { message } => message.len(),
                Envelope::Info(Info::Timer(fired)) => fired.tag.len(),
                Envelope::Info(Info::Published(p)) => p.topic.len() + p.payload.len(),
                Envelope::Stop { .. } => 0,
            }
    }

    /// Answer the envelope's sender (if it has one) with `error`.
    fn fail(self, error: Error) {
        match self {
            Envelope::Call { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Envelope::Stop { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Envelope::Cast { .. } | Envelope::Info(_) => {}
        }
    }
}

/// How a call reached a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    /// Routed to the key's owner: refused once the key is a survivor.
    Routed,
    /// Through a local handle on this node: reaches survivors too.
    LocalHandle,
}

/// What a key process knows about itself and its node.
pub(crate) struct KeyEnv {
    pub(crate) module: Arc<str>,
    pub(crate) key: Arc<str>,
    pub(crate) token: OwnershipToken,
    pub(crate) control: Arc<KeyControl>,
    pub(crate) mailbox: WeakMailbox,
    pub(crate) node: Weak<NodeShared>,
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
    wasi: WasiCtx,
    table: ResourceTable,
    limits: StoreLimits,
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
    /// demotes it to the key's task (see [`InlineCall`]).
    inline: bool,
    /// What the key used (its task's polls and inline calls' move it).
    cpu: Arc<CpuMeter>,
    /// The key's `cpu_budget`; `None` for a whole core.
    budget: Option<CpuBudget>,
    /// The node's scheduler, the key's place in it, and its tenant.
    scheduler: Arc<Scheduler>,
    seat: Arc<Seat>,
    tenant: Arc<str>,
    /// Why the host interrupted the guest, when it did (CPU or memory limit).
    death: Option<String>,
    pub(crate) timers: HashMap<u64, AbortHandle>,
    pub(crate) next_timer: u64,
    /// Each subscribed topic, with the host bytes it holds.
    pub(crate) subscriptions: BTreeMap<String, Held>,
    /// The key's publish rate limit (`max_publishes_per_second`).
    pub(crate) publishes: PublishBucket,
}

impl WasiView for KeyCtx {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl Drop for KeyCtx {
    fn drop(&mut self) {
        for (_, timer) in self.timers.drain() {
            timer.abort();
        }
        if let Some(node) = self.env.node.upgrade() {
            for topic in std::mem::take(&mut self.subscriptions).into_keys() {
                node.pubsub.unsubscribe(
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
    pub(crate) fn gate(&self) -> wasmtime::Result<Arc<NodeShared>> {
        if self.env.control.is_killed() {
            wasmtime::bail!("effect refused: this key process was killed");
        }
        let Some(node) = self.env.node.upgrade() else {
            wasmtime::bail!("effect refused: the node has stopped");
        };
        if self.env.on_fence == OnFence::Terminate && !node.may_act() {
            wasmtime::bail!("effect refused: the node is fenced");
        }
        Ok(node)
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
                    tokio::time::sleep(wait).await;
                    cpu.throttled(wait);
                    scheduler.next_turn(&tenant, &seat).await;
                })
            }
        }
    }

    /// How long the key must wait for its `cpu_budget` and its tenant's
    /// `cpu_budget_per_tenant` before it runs again, if it is over either.
    fn throttle(&mut self) -> Option<Duration> {
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
pub(crate) struct Death(pub(crate) String);

/// A running key process: a store and the instance in it.
pub(crate) struct KeyProcess {
    store: Store<KeyCtx>,
    guest: KeyModule,
    /// The key's CPU meter (the key's task and inline calls move it).
    cpu: Arc<CpuMeter>,
}

impl KeyProcess {
    /// Instantiate `module` for a key and run its `init`.
    async fn start(
        node: &NodeShared,
        module: &CompiledModule,
        env: Arc<KeyEnv>,
        handoff: Option<Vec<u8>>,
        (cpu, seat): (Arc<CpuMeter>, Arc<Seat>),
    ) -> Result<Self> {
        let options = &module.options;
        let log = Arc::new(GuestLogger::new(
            env.module.clone(),
            env.key.clone(),
            LogLimits {
                lines_per_second: options.max_log_lines_per_second,
                bytes_per_second: options.max_log_bytes_per_second.as_u64(),
            },
            node.metrics.guest_log_counters(&env.module),
        ));
        let wasi = crate::sandbox::wasi_ctx(options, &log)?;
        let memory_limit = options.memory_limit.as_u64() as usize;
        let limits = wasmtime::StoreLimitsBuilder::new()
            .memory_size(memory_limit)
            .table_elements(MAX_TABLE_ELEMENTS)
            .instances(64)
            .trap_on_grow_failure(true)
            .build();
        let tick = node.config.epoch_tick.as_nanos().max(1);
        let cpu_limit_ticks = (options.cpu_limit.as_nanos() / tick).max(1) as u64;
        let tenant: Arc<str> = Arc::from(crate::auth::tenant_of(&env.module).unwrap_or(""));
        let ctx = KeyCtx {
            wasi,
            table: crate::sandbox::resource_table(),
            limits,
            memory_limit,
            env: env.clone(),
            cpu_ticks: 0,
            cpu_limit_ticks,
            tick_nanos: u64::try_from(tick).unwrap_or(u64::MAX),
            host_nanos: 0,
            log,
            resuming: false,
            inline: false,
            cpu: cpu.clone(),
            budget: CpuBudget::for_key(
                options.cpu_budget,
                options.cpu_budget_window,
                std::time::Instant::now(),
            ),
            scheduler: node.runtime.scheduler.clone(),
            seat,
            tenant,
            death: None,
            timers: HashMap::new(),
            next_timer: 1,
            subscriptions: BTreeMap::new(),
            publishes: PublishBucket::new(options.max_publishes_per_second, node.clock.now()),
        };
        let mut store = Store::new(&node.runtime.engine, ctx);
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
                && ctx.env.node.upgrade().is_none_or(|node| !node.may_act())
            {
                ctx.env.control.kill("the node is fenced");
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
        let guest = match module.pre.instantiate_async(&mut store).await {
            Ok(guest) => guest,
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
        let mut process = KeyProcess { store, guest, cpu };
        process.begin_callback();
        let init = process
            .guest
            .fief_key_lifecycle()
            .call_init(&mut process.store, &env.key, handoff.as_deref())
            .await;
        process.end_callback();
        match init {
            Ok(Ok(())) => Ok(process),
            // Guest text is cut where it enters the host: the refusal goes
            // to the caller, the log and peers.
            Ok(Err(refusal)) => Err(Error::InitRefused(bounded(refusal, MAX_GUEST_ERROR))),
            Err(e) => Err(Error::KeyDied(process.death(&e).0)),
        }
    }

    /// The callback ended: give back its turn, if it holds one.
    fn end_callback(&mut self) {
        let ctx = self.store.data();
        ctx.scheduler.release(&ctx.seat);
    }

    /// How long the key must wait for its `cpu_budget` before its next
    /// callback, if it is over it.
    fn throttle(&mut self) -> Option<Duration> {
        self.store.data_mut().throttle()
    }

    fn begin_callback(&mut self) {
        let ctx = self.store.data_mut();
        ctx.cpu_ticks = 0;
        ctx.host_nanos = 0;
        ctx.log.take_host_nanos();
        ctx.resuming = false;
        self.store.set_epoch_deadline(1);
    }

    fn death(&mut self, error: &wasmtime::Error) -> Death {
        Death(describe_failure(&mut self.store, error))
    }

    async fn handle_call(&mut self, message: &[u8]) -> Result<Result<Vec<u8>, String>, Death> {
        self.begin_callback();
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handle_call(&mut self.store, message)
            .await;
        self.end_callback();
        // The guest's error is cut where it enters the host: it travels to
        // the caller (and on to HTTP, logs and peers) like a reply.
        r.map(|result| result.map_err(|why| bounded(why, MAX_GUEST_ERROR)))
            .map_err(|e| self.death(&e))
    }

    async fn handle_cast(&mut self, message: &[u8]) -> Result<(), Death> {
        self.begin_callback();
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handle_cast(&mut self.store, message)
            .await;
        self.end_callback();
        r.map_err(|e| self.death(&e))
    }

    async fn handle_info(&mut self, info: &Info) -> Result<(), Death> {
        if let Info::Timer(TimerFired { id, .. }) = info {
            // A timer cancelled after it fired but before it was delivered
            // is not delivered.
            if self.store.data_mut().timers.remove(id).is_none() {
                return Ok(());
            }
        }
        self.begin_callback();
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handle_info(&mut self.store, info)
            .await;
        self.end_callback();
        r.map_err(|e| self.death(&e))
    }

    async fn handle_fence(&mut self, deadline: Duration) -> Result<FenceDecision, Death> {
        self.begin_callback();
        let deadline_ms = u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX);
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handle_fence(&mut self.store, deadline_ms)
            .await;
        self.end_callback();
        r.map(|decision| match decision {
            FenceDecision::Stop(reason) => FenceDecision::Stop(bounded(reason, MAX_GUEST_ERROR)),
            other => other,
        })
        .map_err(|e| self.death(&e))
    }

    async fn handoff(&mut self) -> Result<Option<Vec<u8>>, Death> {
        self.begin_callback();
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_handoff(&mut self.store)
            .await;
        self.end_callback();
        r.map_err(|e| self.death(&e))
    }

    async fn terminate(&mut self, reason: &StopReason) -> Result<(), Death> {
        self.begin_callback();
        let r = self
            .guest
            .fief_key_lifecycle()
            .call_terminate(&mut self.store, reason)
            .await;
        self.end_callback();
        r.map_err(|e| self.death(&e))
    }

    fn timers_armed(&self) -> usize {
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

/// A live key's entry in its module's table.
pub(crate) struct KeyHandle {
    tx: Mailbox,
    process: Arc<ProcessCell>,
    control: Arc<KeyControl>,
    generation: u64,
    started_at: SystemTime,
    partition: PartitionId,
    on_fence: OnFence,
    handle_fence_deadline: Duration,
}

/// A deployed module name: its current version and its live keys.
///
/// Keys are tracked per name, not per version, so a redeploy never lets two
/// versions run one key at once: live keys finish on their version, new
/// activations use the new one.
pub(crate) struct ModuleSlot {
    pub(crate) name: Arc<str>,
    current: RwLock<Arc<CompiledModule>>,
    keys: Mutex<HashMap<Box<str>, KeyHandle>>,
    next_generation: AtomicU64,
}

/// One live key, as reported by [`crate::Instance::keys`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct LiveKey {
    /// The module.
    pub module: String,
    /// The key.
    pub key: String,
    /// Its partition.
    pub partition: u32,
    /// When its process started.
    #[serde(with = "humantime_serde")]
    pub since: SystemTime,
    /// Host memory the node holds for it outside its linear memory (queued
    /// messages, timer tags, subscriptions), in bytes.
    pub host_bytes: usize,
}

impl ModuleSlot {
    pub(crate) fn new(name: &str, module: CompiledModule) -> Self {
        ModuleSlot {
            name: Arc::from(name),
            current: RwLock::new(Arc::new(module)),
            keys: Mutex::new(HashMap::new()),
            next_generation: AtomicU64::new(1),
        }
    }

    /// The version new activations use.
    pub(crate) fn current(&self) -> Arc<CompiledModule> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Make `module` the version new activations use.
    pub(crate) fn replace(&self, module: CompiledModule) {
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(module);
    }

    pub(crate) fn live_keys(&self) -> usize {
        lock(&self.keys).len()
    }

    /// Messages waiting in the mailboxes of this module's live keys.
    pub(crate) fn queued(&self) -> usize {
        lock(&self.keys)
            .values()
            .map(|h| h.tx.max_capacity() - h.tx.capacity())
            .sum()
    }

    pub(crate) fn list(&self) -> Vec<LiveKey> {
        lock(&self.keys)
            .iter()
            .map(|(key, h)| LiveKey {
                module: self.name.to_string(),
                key: key.to_string(),
                partition: h.partition.0,
                since: h.started_at,
                host_bytes: h.tx.ledger().used(),
            })
            .collect()
    }

    /// Put `envelope` in the key's mailbox, activating the key first if it
    /// has no live process.
    pub(crate) fn deliver(
        self: &Arc<Self>,
        node: &Arc<NodeShared>,
        key: &str,
        partition: PartitionId,
        token: OwnershipToken,
        envelope: Envelope,
    ) -> Result<()> {
        self.deliver_in(&mut lock(&self.keys), node, key, partition, token, envelope)
    }

    /// [`deliver`](Self::deliver) under the key-table lock, held as `keys`.
    fn deliver_in(
        self: &Arc<Self>,
        keys: &mut HashMap<Box<str>, KeyHandle>,
        node: &Arc<NodeShared>,
        key: &str,
        partition: PartitionId,
        token: OwnershipToken,
        envelope: Envelope,
    ) -> Result<()> {
        let envelope = match keys.get(key) {
            Some(handle) => match handle.tx.try_send(envelope) {
                Ok(()) => return Ok(()),
                // The process is gone but its entry not yet removed: its
                // task removes it under this lock right after the store is
                // dropped, so it is safe to replace here.
                Err(Refused::Closed(envelope)) => envelope,
                Err(refused) => return Err(refused.into_error(&self.name, key, &handle.tx)),
            },
            None => envelope,
        };
        let module = self.current();
        let options = &module.options;
        if keys.len() >= options.max_live_keys as usize {
            return Err(Error::TooManyKeys {
                module: self.name.to_string(),
                limit: options.max_live_keys,
            });
        }
        // Routed before a move began draining the partition, this message
        // must not start a process the drain has already missed: the check
        // and the insert below happen under this module's key-table lock,
        // which the drain's listing takes after it marked the partition (found by the
        // leave test: a call routed just before the drain started a fresh
        // process after the handoff, and the key counted from 0 again).
        let handoff = node.admit_activation(&self.name, key, partition, token)?;
        let tenant = crate::auth::tenant_of(&self.name).unwrap_or("");
        let ledger = Ledger::key(
            &node.host_bytes.of(tenant),
            usize::try_from(options.max_host_bytes_per_key.as_u64()).unwrap_or(usize::MAX),
        );
        let (tx, rx) = mailbox::channel(options.mailbox_depth as usize, ledger);
        let control = Arc::new(KeyControl::default());
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let env = Arc::new(KeyEnv {
            module: self.name.clone(),
            key: Arc::from(key),
            token,
            control: control.clone(),
            mailbox: tx.downgrade(),
            node: Arc::downgrade(node),
            generation,
            on_fence: options.on_fence,
            max_timers: options.max_timers_per_key,
            max_subscriptions: options.max_subscriptions_per_key,
            max_handoff: node.max_handoff_size(options),
        });
        // A new mailbox has room for one message, but its bytes may pass the
        // tenant's budget: then no process is started for it.
        if let Err(refused) = tx.try_send(envelope) {
            return Err(refused.into_error(&self.name, key, &tx));
        }
        let process = Arc::new(ProcessCell::new(None));
        // The task holds the process from the start; callers go through the
        // mailbox until it has started.
        let held = process
            .clone()
            .try_lock_owned()
            .unwrap_or_else(|_| unreachable!("a new cell is unlocked"));
        keys.insert(
            Box::from(key),
            KeyHandle {
                tx,
                process,
                control,
                generation,
                started_at: SystemTime::now(),
                partition,
                on_fence: options.on_fence,
                handle_fence_deadline: options.handle_fence_deadline,
            },
        );
        node.tasks.spawn_on(
            run_key(node.clone(), self.clone(), module, env, rx, handoff, held),
            &node.guest,
        );
        Ok(())
    }

    /// Call `key` and wait for its reply, activating it first if it has no
    /// live process.
    ///
    /// When the key is idle (nothing in its mailbox, nothing being
    /// processed) and the call is routed, the call runs right here on the
    /// caller's task, holding the key's process: no hop to the key's task
    /// and back. Otherwise it goes through the mailbox like every other
    /// message. Either way the key runs one callback at a time, in arrival
    /// order.
    pub(crate) async fn call(
        self: &Arc<Self>,
        node: &Arc<NodeShared>,
        key: &str,
        partition: PartitionId,
        token: OwnershipToken,
        message: Vec<u8>,
        via: Via,
    ) -> Result<Vec<u8>> {
        if via == Via::Routed
            && !node.reports_events()
            && let Some((process, control, cpu)) = self.try_inline(key)
        {
            // Served only while the node may act; otherwise the key's task
            // decides (a terminate key dies, a survivor refuses).
            if !control.is_killed() && !control.is_survivor() && node.may_act() {
                control.touch();
                let future: InlineFuture = Box::pin(run_inline(process, control.clone(), message));
                return InlineCall::new(future, control, cpu).await;
            }
        }
        let (reply, rx) = oneshot::channel();
        self.deliver(
            node,
            key,
            partition,
            token,
            Envelope::Call {
                message,
                reply,
                via,
            },
        )?;
        rx.await
            .map_err(|_| Error::KeyDied("the key process went away".to_owned()))?
    }

    /// The key's process, if the key is live and idle: its mailbox is empty,
    /// its task is not processing a message, and no one else holds it.
    fn try_inline(&self, key: &str) -> Option<(ProcessGuard, Arc<KeyControl>, Arc<CpuMeter>)> {
        let keys = lock(&self.keys);
        let handle = keys.get(key)?;
        // Mailbox first, then `receiving`: a message the task took out
        // before the mailbox was read is still flagged (see `receive`).
        if handle.tx.capacity() != handle.tx.max_capacity() {
            return None;
        }
        let mut process = handle.process.clone().try_lock_owned().ok()?;
        if handle.control.receiving.load(Ordering::SeqCst) {
            return None;
        }
        // A key over its CPU budget waits on its own task, not a caller's.
        let running = process.as_mut()?;
        if running.throttle().is_some() {
            return None;
        }
        let cpu = running.cpu.clone();
        Some((process, handle.control.clone(), cpu))
    }

    /// Kill every live key whose partition `select` accepts. Returns how many.
    pub(crate) fn kill_where(&self, reason: &str, select: impl Fn(PartitionId) -> bool) -> usize {
        let keys = lock(&self.keys);
        keys.values()
            .filter(|h| select(h.partition))
            .filter(|h| h.control.kill(reason))
            .count()
    }

    /// The fence, for this module's live keys: `terminate` keys are killed;
    /// `continue` and `callback` keys leave the kill tree for `limbo` (a
    /// callback key is also ordered to run `handle-fence`, and is killed if
    /// it has not answered by its deadline). Returns how many were killed.
    pub(crate) fn fence_keys(&self, limbo: &Limbo) -> usize {
        let mut keys = lock(&self.keys);
        // The `terminate` keys (most, usually) are killed after the lock is
        // released: waking thousands of key tasks under it would stall every
        // worker that runs one of them into `remove_if_current`. No guest
        // code of theirs runs meanwhile: past the fence point the epoch
        // callback and the key loop refuse to run it (see `KeyProcess::start`).
        let mut doomed: Vec<Arc<KeyControl>> = Vec::with_capacity(keys.len());
        let mut survivors: Vec<Box<str>> = Vec::new();
        for (name, handle) in keys.iter() {
            if handle.on_fence == OnFence::Terminate {
                doomed.push(handle.control.clone());
            } else {
                survivors.push(name.clone());
            }
        }
        for name in survivors {
            let mode = keys[&name].on_fence;
            let handle = keys.remove(&name).expect("listed above");
            let deadline = handle.handle_fence_deadline;
            let callback = (mode == OnFence::Callback).then_some(deadline);
            handle.control.fence(callback);
            if callback.is_some() {
                let control = handle.control.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(deadline).await;
                    if !control.fence_answered.load(Ordering::SeqCst)
                        && control.kill("handle-fence did not answer by its deadline")
                    {
                        tracing::warn!("a key was killed: handle-fence overran its deadline");
                    }
                });
            }
            limbo.insert(Survivor {
                entry: LimboEntry {
                    module: self.name.to_string(),
                    key: name.to_string(),
                    partition: handle.partition.0,
                    since: SystemTime::now(),
                    mode: mode_name(mode),
                },
                generation: handle.generation,
                control: handle.control,
                mailbox: handle.tx,
            });
        }
        drop(keys);
        doomed
            .iter()
            .filter(|control| control.kill("the node fenced"))
            .count()
    }

    /// A live key's mailbox (its local handle on this node).
    pub(crate) fn mailbox(&self, key: &str) -> Option<Mailbox> {
        lock(&self.keys).get(key).map(|h| h.tx.clone())
    }

    /// Kill one key. Returns whether it was live.
    pub(crate) fn kill(&self, key: &str, reason: &str) -> bool {
        lock(&self.keys)
            .get(key)
            .is_some_and(|h| h.control.kill(reason))
    }

    /// Ask a live key to stop gracefully. `None` when the key is not live.
    pub(crate) fn stop(
        &self,
        key: &str,
        reason: StopReason,
    ) -> Option<oneshot::Receiver<Result<Option<Vec<u8>>>>> {
        let keys = lock(&self.keys);
        let handle = keys.get(key)?;
        let (reply, rx) = oneshot::channel();
        // A stop must not be refused for a full mailbox: wait for room off
        // the lock.
        let tx = handle.tx.clone();
        drop(keys);
        tokio::spawn(async move {
            // The key stopped on its own first (its process is gone, and
            // with it any state): there is nothing to hand on.
            if let Err(Envelope::Stop { reply, .. }) =
                tx.send_uncharged(Envelope::Stop { reason, reply }).await
            {
                let _ = reply.send(Ok(None));
            }
        });
        Some(rx)
    }

    /// The names of every live key, for a graceful shutdown.
    pub(crate) fn live_key_names(&self) -> Vec<String> {
        lock(&self.keys).keys().map(|k| k.to_string()).collect()
    }

    fn remove_if_current(&self, key: &str, generation: u64) {
        let mut keys = lock(&self.keys);
        if keys.get(key).is_some_and(|h| h.generation == generation) {
            keys.remove(key);
        }
    }

    /// Whether an idle key may retire: its mailbox is empty and it is still
    /// the key's current process. Its entry stays until its store is
    /// dropped ([`retired`](Self::retired)): a message arriving meanwhile
    /// waits in its mailbox instead of starting a second process of the key
    /// beside the one running `terminate(idle)` (issue "One ownership state
    /// machine", guarantee 1).
    fn may_retire(&self, key: &str, generation: u64, rx: &MailboxRx) -> bool {
        let keys = lock(&self.keys);
        rx.is_empty() && keys.get(key).is_some_and(|h| h.generation == generation)
    }

    /// A retired key's store was dropped: remove its entry and give the
    /// calls and casts that arrived during its `terminate(idle)`, in their
    /// order, to a fresh process of the key (under the lock, so none
    /// overtakes them). One that cannot be delivered (the partition moved
    /// meanwhile) is dropped, so its caller hears that the process went
    /// away; a stop order is answered with no state (the key stopped on its
    /// own), and a publication for the old process's subscription is
    /// dropped with it.
    fn retired(self: &Arc<Self>, node: &Arc<NodeShared>, env: &KeyEnv, rx: &mut MailboxRx) {
        let mut keys = lock(&self.keys);
        let Some(handle) = keys
            .get(&*env.key)
            .filter(|h| h.generation == env.generation)
        else {
            return;
        };
        let partition = handle.partition;
        keys.remove(&*env.key);
        rx.close();
        while let Ok(envelope) = rx.try_recv() {
            match envelope {
                Envelope::Stop { reply, .. } => {
                    let _ = reply.send(Ok(None));
                }
                Envelope::Info(_) => {}
                routed @ (Envelope::Call { .. } | Envelope::Cast { .. }) => {
                    if let Err(error) =
                        self.deliver_in(&mut keys, node, &env.key, partition, env.token, routed)
                    {
                        tracing::debug!(module = %self.name, key = %env.key, %error, "a message that arrived while the key retired was not delivered");
                    }
                }
            }
        }
    }
}

/// A point in a key process's life, reported to the instance's observer.
///
/// `Started` is reported before the store is created and `Ended` after it
/// was dropped, so the interval between them covers every instant at which
/// the process could run guest code or act. Failure tests collect these from
/// every node and check that no two intervals of one key overlap.
#[derive(Clone, Debug)]
pub struct KeyLife {
    /// The node hosting the process.
    pub node: String,
    /// The module.
    pub module: String,
    /// The key.
    pub key: String,
    /// Which end of the life this is.
    pub event: KeyLifeEvent,
    /// When, on this process's monotonic clock.
    pub at: std::time::Instant,
}

/// Which end of a key process's life a [`KeyLife`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyLifeEvent {
    /// The process is about to be created.
    Started,
    /// The process's store has been dropped.
    Ended,
}

/// How a key's message loop ended.
enum Exit {
    /// Killed by the host (fence, operator, shutdown).
    Killed,
    /// Died on its own (trap, CPU or memory limit).
    Died(String),
    /// Stopped gracefully on request.
    Stopped,
    /// Stopped for being idle: messages that came during its `terminate`
    /// go to its next process.
    Retired,
}

/// The task that owns one key process.
///
/// The task holds the process (`held`) while it starts it and while it
/// processes a message, and lets go of it while it waits for the next one,
/// so that a routed call to an idle key can run on its caller's task (see
/// [`ModuleSlot::call`]).
///
/// Everything the task does is charged to the key's CPU meter (its guest
/// code, and the host's work on its messages): that is what its
/// `cpu_budget` bounds.
async fn run_key(
    node: Arc<NodeShared>,
    slot: Arc<ModuleSlot>,
    module: Arc<CompiledModule>,
    env: Arc<KeyEnv>,
    rx: MailboxRx,
    handoff: Option<Vec<u8>>,
    held: ProcessGuard,
) {
    let tenant = crate::auth::tenant_of(&env.module).unwrap_or("");
    let cpu = Arc::new(CpuMeter::new(
        node.metrics.key_cpu_counters(&env.module),
        node.tenant_cpu
            .of(tenant, || node.metrics.tenant_cpu_counters(tenant)),
    ));
    let (scheduler, seat) = (node.runtime.scheduler.clone(), Arc::new(Seat::default()));
    let mut task = Box::pin(drive_key(
        node,
        slot,
        module,
        env,
        rx,
        handoff,
        held,
        (cpu.clone(), seat.clone()),
    ));
    std::future::poll_fn(|cx| {
        let poll = poll_metered(&cpu, task.as_mut(), cx);
        if poll.is_pending() {
            // A callback waiting on the host holds no turn.
            scheduler.release_if_blocked(&seat);
        }
        poll
    })
    .await;
}

/// The body of [`run_key`].
#[allow(clippy::too_many_arguments)]
async fn drive_key(
    node: Arc<NodeShared>,
    slot: Arc<ModuleSlot>,
    module: Arc<CompiledModule>,
    env: Arc<KeyEnv>,
    mut rx: MailboxRx,
    handoff: Option<Vec<u8>>,
    held: ProcessGuard,
    cpu: (Arc<CpuMeter>, Arc<Seat>),
) {
    let control = env.control.clone();
    let key = env.key.clone();
    let cell = ProcessGuard::mutex(&held).clone();
    let mut held = Some(held);
    node.observe(&env.module, &key, KeyLifeEvent::Started);
    let started = tokio::select! {
        biased;
        () = control.killed() => Err(Error::KeyDied(format!(
            "killed: {}", control.reason().unwrap_or_default()
        ))),
        // Boxed, like the other guest calls below: the task's own future
        // stays small (it lives as long as the key).
        r = Box::pin(KeyProcess::start(&node, &module, env.clone(), handoff, cpu)) => r,
    };
    match started {
        Ok(process) => {
            if let Some(guard) = held.as_mut() {
                **guard = Some(process);
            }
        }
        Err(error) => {
            tracing::warn!(module = %slot.name, key = %key, %error, "key failed to start");
            drop(held);
            node.observe(&env.module, &key, KeyLifeEvent::Ended);
            slot.remove_if_current(&key, env.generation);
            control.exited.send_replace(true);
            rx.close();
            while let Ok(envelope) = rx.try_recv() {
                envelope.fail(error.clone());
            }
            return;
        }
    }
    tracing::debug!(module = %slot.name, key = %key, "key started");
    let idle_timeout = module.options.idle_timeout;
    // One registered waiter for kills, fence orders, orphans and inline
    // deaths, and one idle timer, for the task's whole life: a message arms
    // neither.
    let changed = control.changed.notified();
    tokio::pin!(changed);
    changed.as_mut().enable();
    // The idle timer fires every `idle_timeout`; the key retires when a
    // whole period passed with no message (mailbox or inline), so an idle
    // key stops between one and two `idle_timeout`s after its last message,
    // and a message costs a counter increment, not a clock read.
    let idle = tokio::time::sleep(idle_timeout);
    tokio::pin!(idle);
    let mut messages: u64 = 0;
    let mut seen_at_last_tick = 0;
    // The answer to a call that ended the process, given once the key's
    // entry is gone, so that a caller retrying at once starts a fresh
    // process instead of finding the dying one.
    let mut last_word: Option<LastWord> = None;
    let exit = loop {
        control.receiving.store(false, Ordering::SeqCst);
        if control.is_killed() {
            break Exit::Killed;
        }
        if let Some(why) = control.death() {
            break Exit::Died(why);
        }
        if let Some(orphan) = control.take_orphan() {
            // An inline call whose caller went away (its reply has no one
            // to go to) or that was demoted (its caller waits): finish it
            // (it holds the process).
            if let Some((reply, outcome)) = orphan.finish(&control).await {
                last_word = Some(Box::new(move || {
                    let _ = reply.send(outcome);
                }));
            }
            continue;
        }
        if control.fence_ordered.load(Ordering::SeqCst) {
            hold(&mut held, &cell, &control, &mut changed).await;
            let (Some(deadline), Some(process)) = (
                control.take_fence_order(),
                held.as_mut().and_then(|guard| guard.as_mut()),
            ) else {
                continue;
            };
            // Callback mode: the key decides, under a deadline the fencer
            // enforces with a kill; this loop never delays it.
            let answer = tokio::select! {
                biased;
                () = control.killed_with(&mut changed) => break Exit::Killed,
                answer = Box::pin(process.handle_fence(deadline)) => answer,
            };
            control.fence_answered.store(true, Ordering::SeqCst);
            match answer {
                Ok(FenceDecision::Continue) => continue,
                Ok(FenceDecision::Stop(reason)) => {
                    let _ = Box::pin(process.terminate(&StopReason::Fenced(reason))).await;
                    break Exit::Stopped;
                }
                Err(Death(why)) => break Exit::Died(why),
            }
        }
        // Idle: let go of the process while waiting.
        drop(held.take());
        let envelope = tokio::select! {
            biased;
            () = &mut changed => {
                // The flags are read at the top of the loop.
                rearm(&control, &mut changed);
                continue;
            }
            envelope = receive(&mut rx, &control) => match envelope {
                Some(envelope) => envelope,
                None => break Exit::Stopped,
            },
            () = &mut idle => {
                let seen = messages + control.inline_calls();
                let quiet = seen == seen_at_last_tick;
                seen_at_last_tick = seen;
                idle.as_mut().reset(tokio::time::Instant::now() + idle_timeout);
                // Retire only with no timer armed and no inline call
                // running, under the lock every sender takes.
                if quiet
                    && let Ok(guard) = cell.clone().try_lock_owned()
                    && guard.as_ref().is_some_and(|p| p.timers_armed() == 0)
                    && slot.may_retire(&key, env.generation, &rx)
                {
                    let process = held.insert(guard).as_mut().expect("checked above");
                    let _ = Box::pin(process.terminate(&StopReason::Idle)).await;
                    node.metrics.killed(&slot.name, "idle");
                    break Exit::Retired;
                }
                continue;
            }
        };
        messages += 1;
        hold(&mut held, &cell, &control, &mut changed).await;
        let Some(process) = held.as_mut().and_then(|guard| guard.as_mut()) else {
            // The process died during an inline call.
            envelope.fail(Error::KeyDied(
                "the key process died; the message was not processed, retry".to_owned(),
            ));
            continue;
        };
        // Nothing routed is served past the fence, even if this task was
        // paused across the fence point and the fence sweep has not reached
        // it yet: a `terminate` key dies; a survivor refuses routed messages
        // (its timers, subscriptions and local handles still reach it).
        // For the event log, read before the check (see `report_processing`).
        let checked_at = node.reports_events().then(std::time::Instant::now);
        let fenced = control.is_survivor() || !node.may_act();
        if fenced {
            if env.on_fence == OnFence::Terminate {
                control.kill("the node is fenced");
                envelope.fail(Error::Fenced);
                break Exit::Killed;
            }
            if envelope.is_routed() {
                envelope.fail(Error::Fenced);
                continue;
            }
        }
        // A key over its CPU budget waits before its next callback (it is
        // throttled, not killed).
        if let Some(wait) = process.throttle() {
            let throttled = tokio::time::sleep(wait);
            tokio::pin!(throttled);
            tokio::select! {
                biased;
                () = control.killed_with(&mut changed) => {
                    envelope.fail(Error::KeyDied(format!(
                        "killed: {}",
                        control.reason().unwrap_or_default()
                    )));
                    break Exit::Killed;
                }
                () = &mut throttled => process.cpu.throttled(wait),
            }
        }
        if let Some(at) = checked_at {
            crate::event_log::report_processing(&node, &env, &envelope, at);
        }
        let mut waiting = None;
        let outcome = tokio::select! {
            biased;
            () = control.killed_with(&mut changed) => None,
            outcome = Box::pin(dispatch(process, envelope, &mut waiting)) => Some(outcome),
        };
        match outcome {
            None => {
                if let Some(waiting) = waiting {
                    waiting.fail(Error::KeyDied(format!(
                        "killed: {}",
                        control.reason().unwrap_or_default()
                    )));
                }
                break Exit::Killed;
            }
            Some(Step::Continue) => {}
            Some(Step::Stopped(answer)) => {
                last_word = Some(answer);
                break Exit::Stopped;
            }
            Some(Step::Died(why)) => {
                if let Some(waiting) = waiting {
                    let error = Error::KeyDied(why.clone());
                    last_word = Some(Box::new(move || waiting.fail(error)));
                }
                break Exit::Died(why);
            }
        }
    };
    // Drop the store (and with it the instance, its timers and its
    // subscriptions) before the key can be activated again. An inline call
    // still holding the process ends soon: a kill interrupts it, and any
    // other exit happens only while no call runs.
    hold(&mut held, &cell, &control, &mut changed).await;
    if let Some(guard) = held.as_mut() {
        drop(guard.take());
    }
    drop(held);
    node.observe(&env.module, &key, KeyLifeEvent::Ended);
    if matches!(exit, Exit::Retired) {
        slot.retired(&node, &env, &mut rx);
    } else {
        slot.remove_if_current(&key, env.generation);
    }
    node.limbo.remove(&env.module, &key, env.generation);
    control.exited.send_replace(true);
    if let Some(answer) = last_word {
        answer();
    }
    let why = match &exit {
        Exit::Killed => format!("killed: {}", control.reason().unwrap_or_default()),
        Exit::Died(why) => why.clone(),
        Exit::Stopped | Exit::Retired => "the key stopped".to_owned(),
    };
    match &exit {
        Exit::Killed => node.metrics.killed(
            &slot.name,
            crate::metrics::kill_cause(control.reason().as_deref(), None),
        ),
        Exit::Died(why) => node
            .metrics
            .killed(&slot.name, crate::metrics::kill_cause(None, Some(why))),
        Exit::Stopped | Exit::Retired => {}
    }
    match &exit {
        Exit::Killed => {
            tracing::info!(module = %slot.name, key = %key, reason = %why, "key killed")
        }
        Exit::Died(_) => tracing::warn!(module = %slot.name, key = %key, reason = %why, "key died"),
        Exit::Stopped | Exit::Retired => {
            tracing::debug!(module = %slot.name, key = %key, "key stopped")
        }
    }
    rx.close();
    while let Ok(envelope) = rx.try_recv() {
        envelope.fail(Error::KeyDied(format!(
            "{why}; the message was not processed, retry"
        )));
    }
}

/// Take the key's process into `held` (if not held yet): wait for an inline
/// call that holds it, finishing orphaned inline calls meanwhile.
async fn hold<'a>(
    held: &mut Option<ProcessGuard>,
    cell: &Arc<ProcessCell>,
    control: &'a KeyControl,
    changed: &mut Pin<&mut Notified<'a>>,
) {
    if held.is_some() {
        return;
    }
    loop {
        if let Some(orphan) = control.take_orphan()
            && let Some((reply, outcome)) = orphan.finish(control).await
        {
            let _ = reply.send(outcome);
        }
        tokio::select! {
            biased;
            guard = cell.clone().lock_owned() => {
                *held = Some(guard);
                return;
            }
            () = changed.as_mut() => rearm(control, changed),
        }
    }
}

/// Take the next message out of the mailbox, setting `receiving` before it
/// leaves the mailbox (see [`ModuleSlot::try_inline`]); the loop clears it
/// once the message is processed.
async fn receive(rx: &mut MailboxRx, control: &KeyControl) -> Option<Envelope> {
    std::future::poll_fn(|cx| {
        control.receiving.store(true, Ordering::SeqCst);
        let poll = rx.poll_recv(cx);
        if !matches!(poll, std::task::Poll::Ready(Some(_))) {
            control.receiving.store(false, Ordering::SeqCst);
        }
        poll
    })
    .await
}

enum Step {
    Continue,
    /// The process stopped; its stop is answered once it is gone.
    Stopped(LastWord),
    Died(String),
}

/// An answer the key's task gives once the key's entry is gone, so that a
/// caller acting on it at once (a retry, a fresh message) starts a fresh
/// process instead of finding the ending one.
type LastWord = Box<dyn FnOnce() + Send>;

/// The sender waiting on the envelope being processed, kept outside the
/// processing future so that a kill can still answer it with the reason.
enum Waiting {
    Call(oneshot::Sender<Result<Vec<u8>>>),
    Stop(oneshot::Sender<Result<Option<Vec<u8>>>>),
}

impl Waiting {
    fn fail(self, error: Error) {
        match self {
            Waiting::Call(reply) => {
                let _ = reply.send(Err(error));
            }
            Waiting::Stop(reply) => {
                let _ = reply.send(Err(error));
            }
        }
    }
}

/// Process one envelope. Its waiting sender goes into `waiting` and is
/// answered from there, so if this future is dropped (the key was killed)
/// the loop answers it instead.
async fn dispatch(
    process: &mut KeyProcess,
    envelope: Envelope,
    waiting: &mut Option<Waiting>,
) -> Step {
    match envelope {
        Envelope::Call { message, reply, .. } => {
            *waiting = Some(Waiting::Call(reply));
            let outcome = process.handle_call(&message).await;
            let Some(Waiting::Call(reply)) = waiting.take() else {
                unreachable!("set above")
            };
            match outcome {
                Ok(result) => {
                    let _ = reply.send(result.map_err(Error::Rejected));
                    Step::Continue
                }
                Err(Death(why)) => {
                    // Answered by the loop once the process is gone.
                    *waiting = Some(Waiting::Call(reply));
                    Step::Died(why)
                }
            }
        }
        Envelope::Cast { message } => match process.handle_cast(&message).await {
            Ok(()) => Step::Continue,
            Err(Death(why)) => Step::Died(why),
        },
        Envelope::Info(info) => match process.handle_info(&info).await {
            Ok(()) => Step::Continue,
            Err(Death(why)) => Step::Died(why),
        },
        Envelope::Stop { reason, reply } => {
            *waiting = Some(Waiting::Stop(reply));
            let state = if matches!(reason, StopReason::Handoff) {
                match process.handoff().await {
                    // Checked when `handoff` returns: a state too large to
                    // travel is this key's loss alone, reported by name.
                    Ok(Some(state)) if state.len() > process.store.data().env.max_handoff => {
                        Err(Error::HandoffTooLarge {
                            size: state.len(),
                            limit: process.store.data().env.max_handoff,
                        })
                    }
                    Ok(state) => Ok(state),
                    Err(Death(why)) => {
                        if let Some(w) = waiting.take() {
                            w.fail(Error::KeyDied(why.clone()));
                        }
                        return Step::Died(why);
                    }
                }
            } else {
                Ok(None)
            };
            let outcome = process.terminate(&reason).await;
            let Some(Waiting::Stop(reply)) = waiting.take() else {
                unreachable!("set above")
            };
            // The state `handoff` gave travels even if `terminate` then
            // trapped: the process is over either way.
            let answer: LastWord = Box::new(move || {
                let _ = reply.send(state);
            });
            match outcome {
                Ok(()) => Step::Stopped(answer),
                Err(Death(why)) => {
                    answer();
                    Step::Died(why)
                }
            }
        }
    }
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
    let held = ctx
        .env
        .mailbox
        .ledger()
        .hold(crate::host_bytes::TIMER_OVERHEAD + tag.len())?;
    let id = ctx.next_timer;
    ctx.next_timer += 1;
    let mailbox = ctx.env.mailbox.clone();
    let (module, key) = (ctx.env.module.clone(), ctx.env.key.clone());
    let task = tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let Some(tx) = mailbox.upgrade() else { return };
        let fired = Envelope::Info(Info::Timer(TimerFired { id, tag }));
        if tx.try_send_held(fired, held).is_err() {
            tracing::warn!(%module, %key, timer = id, "timer dropped: the key's mailbox is full");
        }
    });
    ctx.timers.insert(id, task.abort_handle());
    Ok(id)
}
