//! The key task: the one task that owns a key process and runs its message
//! loop.
//!
//! This file owns the loop (`run_key`, `drive_key`): starting the process
//! (unless the routed call that activated the key starts it on its own task,
//! `Start::ByCaller`; then the loop hears of that start's failure),
//! taking messages from the mailbox one at a time in arrival order, finishing
//! inline calls handed to it, the `handle-fence` order of a callback key, the
//! idle timeout and eviction orders (both retire the key the same way), a
//! start that waits for a pool slot an eviction frees, throttling over the
//! key's `cpu_budget`, the refusal of routed messages past the fence, and
//! the end: the store dropped, then the
//! key's entry removed, then its waiting senders answered. Everything it does
//! is charged to the key's CPU meter. It must not touch the store's data
//! beyond the process's own methods (`process.rs`), nor remove another
//! process's entry from the key table.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use fief_core::OnFence;
use fief_core::alarm::FireOutcome;
use tokio::sync::futures::Notified;
use tokio::sync::oneshot;

use super::process::{Death, KeyProcess, ProcessCell, ProcessGuard, caller_error};
use super::storage::COMMIT_FAILED;
use super::{
    Envelope, Eviction, KeyControl, KeyEnv, KeyLifeEvent, KeyNode, KeyServices, ModuleSlot, rearm,
};
use crate::bindings::types::{FenceDecision, StopReason};
use crate::cpu_budget::{CpuMeter, poll_metered};
use crate::error::{Error, Result};
use crate::mailbox::MailboxRx;
use crate::module::CompiledModule;
use crate::scheduler::Seat;
use crate::sync::lock;

/// How a key's message loop ended.
enum Exit {
    /// Killed by the host (fence, operator, shutdown).
    Killed,
    /// Died on its own (trap, CPU or memory limit).
    Died(String),
    /// Stopped gracefully on request.
    Stopped,
    /// Stopped for being idle (its idle timeout, or evicted): messages that
    /// came during its `terminate` go to its next process.
    Retired,
    /// Its start failed (on this task, or on the activating caller's,
    /// `Start::ByCaller`): the messages queued meanwhile fail with the same
    /// error.
    StartFailed(Error),
}

/// How a key's process is started.
pub(super) enum Start {
    /// By its task, which holds the process from the start: the message
    /// that activated the key waits in its mailbox.
    Here {
        held: ProcessGuard,
        handoff: Option<Vec<u8>>,
    },
    /// By the routed call that activated the key, on its caller's task
    /// (`inline.rs`, `run_activation`), which holds the process: the task
    /// takes it when a message comes (or finishes the call, when it is
    /// handed over).
    ByCaller,
}

/// A key's CPU meter and its seat in the node's scheduler.
pub(super) type Meter = (Arc<CpuMeter>, Arc<Seat>);

/// A new key's [`Meter`].
pub(super) fn key_meter(services: &KeyServices, module: &CompiledModule, name: &str) -> Meter {
    let tenant = crate::auth::tenant_of(name).unwrap_or("");
    let cpu = Arc::new(CpuMeter::new(
        services.metrics.key_cpu_counters(name),
        services
            .tenant_cpu
            .of(tenant, || services.metrics.tenant_counters(tenant)),
        module.options.cpu_budget < crate::config::CpuShare::WHOLE_CORE,
    ));
    (cpu, Arc::new(Seat::default()))
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
///
/// The task holds its node's services and the node itself (`node`, for
/// nothing but that) for as long as it runs.
#[allow(
    clippy::too_many_arguments,
    reason = "the key task's parts, moved in once from the key table"
)]
pub(super) async fn run_key(
    (services, node): (Arc<KeyServices>, Arc<dyn KeyNode>),
    slot: Arc<ModuleSlot>,
    module: Arc<CompiledModule>,
    env: Arc<KeyEnv>,
    rx: MailboxRx,
    cell: Arc<ProcessCell>,
    start: Start,
    (cpu, seat): Meter,
) {
    let scheduler = services.runtime.scheduler.clone();
    let mut task = Box::pin(drive_key(
        services,
        slot,
        module,
        env,
        rx,
        (cell, start),
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
    // Held to the end: a node lives while any of its key tasks does, as
    // while its own tasks do.
    drop(node);
}

/// The body of [`run_key`].
async fn drive_key(
    services: Arc<KeyServices>,
    slot: Arc<ModuleSlot>,
    module: Arc<CompiledModule>,
    env: Arc<KeyEnv>,
    mut rx: MailboxRx,
    (cell, start): (Arc<ProcessCell>, Start),
    cpu: Meter,
) {
    let control = env.control.clone();
    let key = env.key.clone();
    // One registered waiter for kills, fence orders, orphans and inline
    // deaths, and one idle timer, for the task's whole life: a message arms
    // neither.
    let changed = control.changed.notified();
    tokio::pin!(changed);
    changed.as_mut().enable();
    let mut held = None;
    // The caller of `Start::ByCaller` starts the process; the loop below
    // hears of its end through `changed` as of an inline call's (an orphan,
    // a death, a start's failure), so nothing wakes this task when the
    // caller lets go of the process. Either way a failed start ends the
    // loop at once (`Exit::StartFailed`).
    if let Start::Here {
        held: guard,
        handoff,
    } = start
    {
        services.observe(&env.module, &key, KeyLifeEvent::Started);
        let started = tokio::select! {
            biased;
            () = control.killed() => Err(Error::KeyDied(format!(
                "killed: {}", control.reason().unwrap_or_default()
            ))),
            // Boxed, like the other guest calls below: the task's own
            // future stays small (it lives as long as the key).
            r = Box::pin(start_in_pool(&services, &module, &env, handoff.as_deref(), cpu, false)) => r,
        };
        match started {
            Ok(process) => {
                tracing::debug!(module = %slot.name, key = %key, "key started");
                **held.insert(guard) = Some(process);
            }
            Err(error) => control.start_failed(error),
        }
    }
    let idle_timeout = module.options.idle_timeout;
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
    // The reply to the call just processed, sent once the process is let
    // go (below).
    let mut answer: Option<(CallReply, Result<Vec<u8>>)> = None;
    let exit = loop {
        control.receiving.store(false, Ordering::SeqCst);
        if let Some((reply, result)) = answer.take() {
            // Idle before the caller hears back: a caller that acts at once
            // (calls this key again, inline; or another key of the module,
            // whose activation looks for an idle key to evict) finds this
            // one idle, not finishing.
            drop(held.take());
            let _ = reply.send(result);
        }
        if control.has_failed()
            && let Some(error) = control.start_error()
        {
            break Exit::StartFailed(error);
        }
        if control.is_killed() {
            break Exit::Killed;
        }
        if control.has_failed()
            && let Some(why) = control.death()
        {
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
        if let Some(cause) = control.eviction() {
            match try_retire(&cell, &slot, &env, &rx) {
                Retire::Now(guard) => {
                    let process = held.insert(guard).as_mut().expect("checked in try_retire");
                    let _ = Box::pin(process.terminate(&StopReason::Idle)).await;
                    services.metrics.evicted(&slot.name, cause.label());
                    break Exit::Retired;
                }
                // A message came first: serve it, retire at the next idle
                // moment (the order stays).
                Retire::Busy if !rx.is_empty() => {}
                // The process lock is taken for a moment (a chooser looking
                // at the key, a demoted call on its way here): look again.
                Retire::Busy => {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    continue;
                }
                Retire::Never => {
                    control.cancel_eviction();
                    slot.eviction_abandoned(&key, env.generation);
                }
            }
        }
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
                if quiet && let Retire::Now(guard) = try_retire(&cell, &slot, &env, &rx) {
                    let process = held.insert(guard).as_mut().expect("checked in try_retire");
                    let _ = Box::pin(process.terminate(&StopReason::Idle)).await;
                    services.metrics.killed(&slot.name, "idle");
                    services.metrics.evicted(&slot.name, Eviction::Idle.label());
                    break Exit::Retired;
                }
                continue;
            }
        };
        messages += 1;
        hold(&mut held, &cell, &control, &mut changed).await;
        let Some(process) = held.as_mut().and_then(|guard| guard.as_mut()) else {
            // The process died during an inline call, or its start on the
            // activating caller's task failed.
            envelope.fail(control.start_error().unwrap_or_else(|| {
                Error::KeyDied(
                    "the key process died; the message was not processed, retry".to_owned(),
                )
            }));
            continue;
        };
        // Nothing routed is served past the fence, even if this task was
        // paused across the fence point and the fence sweep has not reached
        // it yet: a `terminate` key dies; a survivor refuses routed messages
        // (its timers, subscriptions and local handles still reach it).
        // For the event log, read before the check (see `report_processing`).
        let checked_at = services.reports_events().then(std::time::Instant::now);
        let fenced = control.is_survivor() || !services.may_act();
        if fenced {
            if env.on_fence == OnFence::Terminate {
                control.kill_one_of_many(super::FENCED);
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
            let cpu = process.cpu.clone();
            let throttled = cpu.sit_out(wait);
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
                () = &mut throttled => {}
            }
        }
        if let Some(at) = checked_at {
            crate::event_log::report_processing(&services, &env, &envelope, at);
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
            Some(Step::Answer(reply, result)) => answer = Some((reply, result)),
            Some(Step::Stopped(answer)) => {
                last_word = Some(answer);
                break Exit::Stopped;
            }
            Some(Step::Died(why)) => {
                if let Some(waiting) = waiting {
                    let error = caller_error(why.clone());
                    last_word = Some(Box::new(move || waiting.fail(error)));
                }
                break Exit::Died(why);
            }
        }
    };
    // A guest that traps at its epoch check because it was killed (by the
    // kill's epoch bump, or by itself finding the node fenced) ends its
    // callback with that death in the same poll that noticed it, before the
    // kill flag is looked at: it was killed, and is counted and logged as a
    // kill (one of many or on its own), not as a guest failure.
    let exit = match exit {
        Exit::Died(_) if control.is_killed() => Exit::Killed,
        exit => exit,
    };
    // Drop the store (and with it the instance, its timers and its
    // subscriptions) before the key can be activated again. An inline call
    // still holding the process ends soon: a kill interrupts it, and any
    // other exit happens only while no call runs.
    hold(&mut held, &cell, &control, &mut changed).await;
    if let Some(guard) = held.as_mut()
        && guard.take().is_some()
    {
        // Its pool slot is free: a start waiting for one may go on.
        services.pool_freed.notify_waiters();
    }
    drop(held);
    services.observe(&env.module, &key, KeyLifeEvent::Ended);
    if matches!(exit, Exit::Retired) {
        slot.retired(&services, &env, &mut rx);
    } else {
        slot.remove_if_current(&key, env.generation);
    }
    // Only a survivor can be in limbo: the fence marks it before it adds
    // it, under the table's lock this task took above to leave. Telling
    // the limbo's task of every other end cost two allocations and a
    // thread's wake-up per key (100 000 at the fence of 100 000 keys; one
    // more per eviction).
    if control.is_survivor() {
        services.limbo.remove(&env.module, &key, env.generation);
    }
    // Counted and logged before anyone hears of the end: a caller that
    // reads the metrics or the log once answered finds this process's end
    // in them.
    // Made only when said: most ends (a fence's, an eviction's) say it to
    // no one.
    let why = || match &exit {
        Exit::Killed => format!("killed: {}", control.reason().unwrap_or_default()),
        Exit::Died(why) => why.clone(),
        Exit::StartFailed(error) => error.to_string(),
        Exit::Stopped | Exit::Retired => "the key stopped".to_owned(),
    };
    match &exit {
        Exit::Killed => services.metrics.killed(
            &slot.name,
            crate::metrics::kill_cause(control.reason(), None),
        ),
        Exit::Died(why) => services
            .metrics
            .killed(&slot.name, crate::metrics::kill_cause(None, Some(why))),
        Exit::StartFailed(_) | Exit::Stopped | Exit::Retired => {}
    }
    match &exit {
        // One of many killed at once: its killer logged the count.
        Exit::Killed if control.killed_with_many() => {
            tracing::debug!(module = %slot.name, key = %key, reason = %why(), "key killed")
        }
        Exit::Killed => {
            tracing::info!(module = %slot.name, key = %key, reason = %why(), "key killed")
        }
        // At a bounded rate per module (`ModuleSlot::end_lines`): a tenant
        // calling its own module whose every call traps must not make the
        // node log a line per request.
        Exit::Died(_) | Exit::StartFailed(_) => {
            if let Some(withheld) = slot.end_lines.admit(std::time::Instant::now()) {
                if withheld > 0 {
                    tracing::warn!(
                        module = %slot.name,
                        withheld,
                        "{withheld} more keys of this module died or failed to start, not logged: \
                         over {} lines a second (fief_key_kills_total counts every death)",
                        slot.end_lines.per_second()
                    );
                }
                if matches!(exit, Exit::Died(_)) {
                    tracing::warn!(module = %slot.name, key = %key, reason = %why(), "key died")
                } else {
                    tracing::warn!(module = %slot.name, key = %key, error = %why(), "key failed to start")
                }
            }
        }
        Exit::Stopped | Exit::Retired => {
            tracing::debug!(module = %slot.name, key = %key, "key stopped")
        }
    }
    control.exited.send_replace(true);
    if let Some(answer) = last_word {
        answer();
    }
    rx.close();
    while let Ok(envelope) = rx.try_recv() {
        envelope.fail(match &exit {
            Exit::StartFailed(error) => error.clone(),
            _ => Error::KeyDied(format!("{}; the message was not processed, retry", why())),
        });
    }
}

/// Whether an idle key may retire now (see [`try_retire`]).
enum Retire {
    /// Yes: the process, held.
    Now(ProcessGuard),
    /// Not now: a message or a call is in the way.
    Busy,
    /// Not as this process: it armed a timer, it has no process, or it is
    /// no longer the key's current one.
    Never,
}

/// May the key retire now: its process free and alive with no timer armed,
/// its mailbox empty and it still the key's current process (checked under
/// the table's lock every sender takes, see [`ModuleSlot::may_retire`]).
fn try_retire(cell: &Arc<ProcessCell>, slot: &ModuleSlot, env: &KeyEnv, rx: &MailboxRx) -> Retire {
    let Ok(guard) = cell.clone().try_lock_owned() else {
        return Retire::Busy;
    };
    if guard.as_ref().is_none_or(|p| p.timers_armed() != 0) {
        return Retire::Never;
    }
    if slot.may_retire(&env.key, env.generation, rx) {
        Retire::Now(guard)
    } else if rx.is_empty() {
        Retire::Never
    } else {
        Retire::Busy
    }
}

/// Most keys one start orders to retire for the node's `max_live_keys`: its
/// own room, and what concurrent starts took past the budget.
const MAX_EVICTIONS_PER_START: usize = 4;

/// How long a key's start waits in all for pool slots freed by evictions
/// before it is refused as `PoolFull`.
const POOL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Start the key's process. At the node's `max_live_keys` (its key stores,
/// not counting those ordered to retire) the node's least recently used idle
/// key is ordered to retire and this one starts at once, in one of the
/// slots the instance pool keeps beyond the budget for keys retiring
/// ([`crate::runtime::pool_slots`]): no start waits for a victim's store to
/// drop. Refused `PoolFull` at once when every live key is busy. Only when
/// the pool itself is full (the reserve used up by retiring keys) does the
/// start wait for a slot to be freed (for at most [`POOL_WAIT`]).
/// `inline`: on the activating caller's task (see [`KeyProcess::start`]).
pub(super) async fn start_in_pool(
    services: &Arc<KeyServices>,
    module: &CompiledModule,
    env: &Arc<KeyEnv>,
    handoff: Option<&[u8]>,
    cpu: Meter,
    inline: bool,
) -> Result<KeyProcess> {
    let deadline = tokio::time::Instant::now() + POOL_WAIT;
    // Past the node's memory budget every activation makes room first (the
    // budget is soft: the new key starts anyway, and the victim retires at
    // its next idle moment).
    if let Some(budget) = services.config.max_guest_memory
        && services.guest_memory.bytes() >= budget.as_u64()
        && let Some(node) = services.node()
    {
        node.evict_oldest_idle(Eviction::MemoryBudget);
    }
    let budget = services.config.max_live_keys as usize;
    if let Some(node) = services.node() {
        let live = services
            .guest_memory
            .stores()
            .saturating_sub(node.evictions_in_flight());
        // Room for this key, and for any that concurrent starts took past
        // the budget (their counts were read before either store existed).
        let wanted = (live + 1)
            .saturating_sub(budget)
            .min(MAX_EVICTIONS_PER_START);
        if wanted > 0
            && (0..wanted)
                .take_while(|_| node.evict_oldest_idle(Eviction::NodeBudget))
                .count()
                == 0
        {
            return Err(Error::PoolFull {
                module: env.module.to_string(),
                detail: format!("all {budget} keys of its max_live_keys are live"),
            });
        }
    }
    rendezvous(services).await;
    loop {
        let freed = services.pool_freed.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        let full =
            match KeyProcess::start(services, module, env.clone(), handoff, cpu.clone(), inline)
                .await
            {
                Err(full @ Error::PoolFull { .. }) => full,
                started => return started,
            };
        let room_coming = services.node().is_some_and(|node| {
            node.evict_oldest_idle(Eviction::NodeBudget) || node.evictions_in_flight() > 0
        });
        if !room_coming {
            return Err(full);
        }
        // The victims' wakes were deferred to the next tick: this start
        // waits for their slots, so it wakes them now.
        services.runtime.tick_wakes.flush();
        if tokio::time::timeout_at(deadline, freed).await.is_err() {
            return Err(full);
        }
    }
}

/// Fault injection (`Instance::inject_start_rendezvous`): wait for the
/// other starts that joined the barrier, if this one joins it.
async fn rendezvous(services: &KeyServices) {
    let barrier = {
        let mut rendezvous = lock(&services.start_rendezvous);
        let Some((barrier, left)) = rendezvous.as_mut() else {
            return;
        };
        let barrier = barrier.clone();
        *left -= 1;
        if *left == 0 {
            *rendezvous = None;
        }
        barrier
    };
    barrier.wait().await;
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

/// Where a call's reply goes.
type CallReply = oneshot::Sender<Result<Vec<u8>>>;

enum Step {
    Continue,
    /// A call was processed: its reply, to send once the process is let go.
    Answer(CallReply, Result<Vec<u8>>),
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
        Envelope::Call {
            message,
            reply,
            trace,
            ..
        } => {
            *waiting = Some(Waiting::Call(reply));
            let outcome = process.handle_call(&message, trace).await;
            let Some(Waiting::Call(reply)) = waiting.take() else {
                unreachable!("set above")
            };
            match outcome {
                Ok(result) => Step::Answer(reply, result.map_err(Error::Rejected)),
                Err(Death(why)) => {
                    // Answered by the loop once the process is gone.
                    *waiting = Some(Waiting::Call(reply));
                    Step::Died(why)
                }
            }
        }
        Envelope::Cast { message, trace } => match process.handle_cast(&message, trace).await {
            Ok(()) => Step::Continue,
            Err(Death(why)) => Step::Died(why),
        },
        Envelope::Info(info) => match process.handle_info(&info).await {
            Ok(()) => Step::Continue,
            Err(Death(why)) => Step::Died(why),
        },
        Envelope::Connection(mut delivery) => {
            delivery.begin();
            let outcome = process.handle_connection(&delivery.event).await;
            delivery.handled();
            match outcome {
                Ok(()) => Step::Continue,
                Err(Death(why)) => Step::Died(why),
            }
        }
        Envelope::Alarm(ticket) => {
            let firing = &ticket.firing;
            let name = firing.alarm.name.clone();
            match process
                .handle_alarm(&name, firing.at_ms, firing.attempt)
                .await
            {
                Ok(outcome) => {
                    ticket.finish(outcome);
                    Step::Continue
                }
                Err(Death(why)) => {
                    ticket.finish(if why.starts_with(COMMIT_FAILED) {
                        FireOutcome::CommitRefused
                    } else {
                        FireOutcome::Trapped
                    });
                    Step::Died(why)
                }
            }
        }
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
