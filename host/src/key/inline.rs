//! Inline calls: a routed call to an idle key, run on its caller's task
//! while it holds the key's process, with no hop to the key's task and back;
//! and inline activations: a routed call to an absent key, which starts its
//! process there too.
//!
//! This file owns such a call from start to end: running `handle-call` under
//! the key's kill switch (`run_inline`), the start before it of an absent
//! key (`run_activation`), its polling by the caller (`InlineCall`, charged
//! to the key's CPU meter), and its hand-over to the key's task (`Orphan`)
//! when its caller goes away or when it is demoted at an epoch tick.
//! A call handed over is always finished, never cut in half. It also makes a
//! caller that runs many inline calls in a row yield its worker
//! (`yield_after_inline`). It must not decide whether a call may run inline
//! or activate (the key table does, `ModuleSlot::call` in `slot.rs`) nor
//! take messages from the key's mailbox.

use std::cell::Cell;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::oneshot;

use fief_core::OnFence;

use super::process::{Death, ProcessGuard, caller_error};
use super::slot::Activation;
use super::task::start_in_pool;
use super::{KeyControl, KeyLifeEvent, KeyServices};
use crate::cpu_budget::{CpuMeter, poll_timed};
use crate::error::{Error, Result};
use crate::metrics::CallCounter;
use crate::trace::TraceContext;

/// An inline call in flight, boxed so that it can move to the key's task if
/// its caller goes away.
pub(super) type InlineFuture = Pin<Box<dyn Future<Output = Result<Vec<u8>>> + Send>>;

/// A half-run inline call handed to the key's task, with where its reply
/// goes (`None`: its caller went away).
pub(super) struct Orphan {
    call: InlineFuture,
    reply: Option<oneshot::Sender<Result<Vec<u8>>>>,
}

impl Orphan {
    /// A finished call no one waits for (unit tests).
    #[cfg(test)]
    pub(super) fn for_test() -> Orphan {
        Orphan {
            call: Box::pin(async { Ok(Vec::new()) }),
            reply: None,
        }
    }

    /// Finish the call; its reply, unless it is to wait until the process's
    /// end is settled (the call killed the process: its caller must not
    /// retry before the key can start afresh).
    pub(super) async fn finish(
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
/// still running at an epoch tick half a tick or more after its poll began
/// (see the epoch callback, `process.rs`), it continues on the guest threads
/// (`crate::scheduler`) while the caller waits for its reply, so a long
/// callback never holds the caller's worker (an API or peer-link worker)
/// for one and a half slices.
pub(super) struct InlineCall<'a> {
    future: Option<InlineFuture>,
    control: Arc<KeyControl>,
    /// The key's CPU meter: the caller's polls are the key's time too.
    cpu: Arc<CpuMeter>,
    /// The reply of a demoted call, from the key's task.
    demoted: Option<oneshot::Receiver<Result<Vec<u8>>>>,
    /// Time the caller spent polling the call (see [`yield_after_inline`]).
    spent: Duration,
    /// `fief_calls_demoted_total` of the key's module.
    demotions: &'a CallCounter,
}

impl<'a> InlineCall<'a> {
    pub(super) fn new(
        future: InlineFuture,
        control: Arc<KeyControl>,
        cpu: Arc<CpuMeter>,
        demotions: &'a CallCounter,
    ) -> Self {
        InlineCall {
            future: Some(future),
            control,
            cpu,
            demoted: None,
            spent: Duration::ZERO,
            demotions,
        }
    }

    /// Time the caller has spent polling the call so far.
    pub(super) fn spent(&self) -> Duration {
        self.spent
    }
}

impl Future for InlineCall<'_> {
    type Output = Result<Vec<u8>>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = &mut *self;
        if let Some(future) = this.future.as_mut() {
            let (poll, spent) = poll_timed(&this.cpu, future.as_mut(), cx);
            this.spent += spent;
            if poll.is_ready() {
                self.future = None;
                return poll;
            }
            if !self.control.demote.swap(false, Ordering::SeqCst) {
                return Poll::Pending;
            }
            // The epoch callback yielded at the first tick: let the key's
            // task finish the call, and wait for its reply. What it held
            // this worker counts against its tenant's share of them.
            self.cpu.tenant().inline_share().note_demoted(self.spent);
            self.demotions.inc();
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

impl Drop for InlineCall<'_> {
    fn drop(&mut self) {
        if let Some(call) = self.future.take() {
            self.control.adopt(Orphan { call, reply: None });
        }
    }
}

/// Run an inline call (or activation) to its reply on the caller's task,
/// then yield if the caller has run inline long enough (see
/// [`yield_after_inline`]).
pub(super) async fn serve_inline(
    future: InlineFuture,
    control: Arc<KeyControl>,
    cpu: Arc<CpuMeter>,
    demotions: &CallCounter,
) -> Result<Vec<u8>> {
    let mut call = InlineCall::new(future, control.clone(), cpu, demotions);
    let reply = (&mut call).await;
    yield_after_inline(call.spent()).await;
    // The call killed the process, or its start failed: answer once the
    // key's task has dropped the store and removed the entry, so a caller
    // that retries at once starts a fresh process instead of finding the
    // ending one (as a death in the key's task answers, see `LastWord`).
    if control.has_failed() {
        control.exited().await;
    }
    reply
}

/// Run `handle-call` on the caller's task, holding the key's process.
pub(super) async fn run_inline(
    process: ProcessGuard,
    control: Arc<KeyControl>,
    message: Vec<u8>,
    trace: Option<TraceContext>,
) -> Result<Vec<u8>> {
    // Its first yield demotes it to the key's task (see `InlineCall`).
    control.demote.store(false, Ordering::SeqCst);
    call_held(process, control, message, trace, true).await
}

/// Start a key's process and run `handle-call` on it, on the caller's task:
/// the activation of an absent key by a routed call, with no hop to the
/// key's task and back (the key's task, spawned beside, takes the process
/// when a message comes).
///
/// Like an inline call, it is demoted to the key's task at its first epoch
/// tick (in `init` or in the call) and handed to it if its caller goes away
/// (`InlineCall`). A start that fails leaves its error for the key's task
/// (`KeyControl::start_failed` wakes it), which fails the messages queued
/// meanwhile with it; a kill, or a fence, before the call is left to the
/// key's task as it would find it. Nothing wakes the key's task when this
/// lets go of the process: it takes it when a message comes.
pub(super) async fn run_activation(
    activation: Activation,
    services: Arc<KeyServices>,
    message: Vec<u8>,
    trace: Option<TraceContext>,
) -> Result<Vec<u8>> {
    let Activation {
        mut held,
        module,
        env,
        handoff,
        meter,
    } = activation;
    let control = env.control.clone();
    services.observe(&env.module, &env.key, KeyLifeEvent::Started);
    control.demote.store(false, Ordering::SeqCst);
    let started = tokio::select! {
        biased;
        () = control.killed() => None,
        started = start_in_pool(&services, &module, &env, handoff.as_deref(), meter, true) => Some(started),
    };
    match started {
        None => return Err(killed(&control)),
        Some(Err(error)) => {
            control.start_failed(error.clone());
            return Err(error);
        }
        Some(Ok(process)) => *held = Some(process),
    }
    tracing::debug!(module = %env.module, key = %env.key, "key started");
    // For the event log, read before the check, as the key loop does; past
    // the fence the key's task finds the process as this leaves it (a
    // `terminate` key is killed, a survivor refuses routed messages).
    let checked_at = services.reports_events().then(std::time::Instant::now);
    if control.is_killed() {
        return Err(killed(&control));
    }
    if control.is_survivor() || !services.may_act() {
        if env.on_fence == OnFence::Terminate {
            control.kill_one_of_many(super::FENCED);
        }
        return Err(Error::Fenced);
    }
    if let Some(at) = checked_at {
        crate::event_log::report_inline_call(&services, &env, &message, at);
    }
    control.touch();
    // `init` used its first slice (the activation was demoted): the call
    // goes on as it is, on the key's task.
    let inline = held.as_ref().is_some_and(|p| p.store.data().inline);
    call_held(held, control, message, trace, inline).await
}

/// The error of a call its key's kill ended.
fn killed(control: &KeyControl) -> Error {
    Error::KeyDied(format!("killed: {}", control.reason().unwrap_or_default()))
}

/// Run `handle-call` on the held process, under the key's kill switch;
/// `inline`: an epoch tick may demote it (see `InlineCall`).
async fn call_held(
    mut process: ProcessGuard,
    control: Arc<KeyControl>,
    message: Vec<u8>,
    trace: Option<TraceContext>,
    inline: bool,
) -> Result<Vec<u8>> {
    let Some(running) = process.as_mut() else {
        return Err(Error::KeyDied("the key process went away".to_owned()));
    };
    running.store.data_mut().inline = inline;
    // The guest traps at its next epoch check once killed; a kill while it
    // waits on the host (e.g. a host call) ends the call here.
    let outcome = {
        let call = running.handle_call(&message, trace);
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
            Err(caller_error(why))
        }
        None => {
            *process = None;
            let why = format!("killed: {}", control.reason().unwrap_or_default());
            control.died(why.clone());
            Err(Error::KeyDied(why))
        }
    }
}

/// Inline guest time a worker thread runs before the task that crosses it
/// yields (see [`yield_after_inline`]).
const INLINE_TIME_BEFORE_YIELD: Duration = Duration::from_micros(100);

thread_local! {
    /// Inline call time on this thread since a caller last yielded for it.
    static INLINE_TIME: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// Count `spent`, one inline call's time, against the calling thread's
/// allowance, and yield once it has used [`INLINE_TIME_BEFORE_YIELD`].
///
/// An inline call that finishes within its slice may never return
/// `Pending`, so a caller that loops over such calls (an embedding
/// program's task, the peer link's reader under a flood) would hold its
/// worker until tokio's cooperative budget ran out (128 calls: measured
/// 1.8 ms; without even that, 182 ms at p99 for an HTTP call on the same
/// node). Yielding every 100 µs of inline time lets the worker poll its
/// sockets and the tasks queued behind the caller, at the price of one
/// reschedule per 100 µs of guest work; a caller that makes one call (an
/// HTTP request) rarely pays it.
pub(super) async fn yield_after_inline(spent: Duration) {
    let used = INLINE_TIME.with(|t| {
        let used = t.get() + spent;
        t.set(if used >= INLINE_TIME_BEFORE_YIELD {
            Duration::ZERO
        } else {
            used
        });
        used
    });
    if used >= INLINE_TIME_BEFORE_YIELD {
        tokio::task::yield_now().await;
    }
}
