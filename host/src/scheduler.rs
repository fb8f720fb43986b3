//! Where guest code runs, and who runs next when the guest threads are busy.
//!
//! [`GuestPool`] is the node's pool of guest threads: a multi-thread tokio
//! runtime of its own that runs every key task. The HTTP API, the peer
//! links and the node's other tasks stay on the runtime the node was started
//! on, and the coordination loop on its thread (`dedicated.rs`), so none of
//! them waits behind guest code: a worker busy with guest code is never one
//! of theirs. The one exception is deliberate and bounded: a routed call to
//! an idle key runs inline on its caller's task for its first slice (see
//! `key/inline.rs`, `run_inline`); a callback still running at its first epoch
//! tick there is *demoted*: it continues on the key's task, in this pool;
//! and a tenant whose calls take more than its share of those workers is
//! served in this pool too (`crate::inline_share`).
//!
//! [`Scheduler`] decides the order in which long callbacks continue. Every
//! running callback yields at each epoch tick; a callback that yields waits
//! for a *turn* before it runs its next slice, and at most `slices` turns
//! (the pool's threads) are out at once. Turns go by weighted fair queueing,
//! first between tenants (each with its weight, the node's
//! `tenant_cpu_weights`, default 1), then between the keys of a tenant
//! (equal): each tenant and each key has a virtual time, the slices it was
//! granted divided by its weight; the waiting tenant with the lowest virtual
//! time gets the next turn, for its waiting key with the lowest. A tenant of
//! weight 3 contending with one of weight 1 gets three turns to its one. A tenant (or key) that starts
//! waiting after an idle spell starts at the virtual time of the last turn
//! granted, so idling banks no credit. Callbacks that finish within their
//! first slice never wait for a turn: short calls stay short however many
//! long ones are queued. A turn is given back at the holder's next yield,
//! when its callback ends, and when its task goes idle inside a callback
//! (waiting on a host import: not computing); the epoch ticker reclaims one
//! left behind by a holder that was dropped.
//!
//! This module must not decide whether a key may run at all: budgets over
//! time are [`crate::cpu_budget`]'s, kills and fences `key/`'s.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::config::GuestThreadPolicy;
use crate::error::{Error, Result};
use crate::sync::lock;

/// The node's guest threads: a tokio runtime that runs every key task.
///
/// Dropped, it shuts down without waiting (it may be dropped on one of its
/// own threads or inside another runtime), dropping the tasks left on it.
pub(crate) struct GuestPool {
    runtime: Option<tokio::runtime::Runtime>,
    handle: Handle,
}

impl GuestPool {
    /// Start `threads` guest threads named `fief-guest`, each lowered at the
    /// OS under `policy` (at niceness `nice` above the process's, or
    /// `SCHED_IDLE`; see `crate::guest_priority`), so that the node's other
    /// threads go first when the cores are contended. What the OS refuses
    /// is logged and the thread runs as it is.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] if the OS refuses the threads.
    pub(crate) fn start(threads: usize, nice: u8, policy: GuestThreadPolicy) -> Result<GuestPool> {
        // Guest threads log where the thread that started the node logs (an
        // embedding program's subscriber, a test's).
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("fief-guest")
            .on_thread_start(move || {
                // The guard would restore the previous default on drop; the
                // thread keeps this one for its whole life.
                std::mem::forget(tracing::dispatcher::set_default(&dispatch));
                crate::guest_priority::lower_this_thread(policy, nice);
            })
            .enable_all()
            .build()
            .map_err(|e| Error::Internal(format!("cannot start the guest threads: {e}")))?;
        let handle = runtime.handle().clone();
        Ok(GuestPool {
            runtime: Some(runtime),
            handle,
        })
    }

    /// The pool's handle, to spawn key tasks on.
    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }
}

impl Drop for GuestPool {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// How many guest threads a node has: `configured`, or one per core when 0.
pub(crate) fn guest_threads(configured: u32) -> usize {
    match configured {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n as usize,
    }
}

/// Ticks after which a turn not given back is reclaimed: the safety net for
/// a turn whose holder was dropped between its grant and its resumption (a
/// kill). Holders give turns back themselves when they yield, when their
/// callback ends and when their task goes idle in a host import
/// ([`Scheduler::release_if_blocked`]); a holder merely preempted by the OS
/// keeps its turn, so the order holds under load.
const TURN_RECLAIM_TICKS: u64 = 100;

/// A tenant's virtual time advances by `VTIME_PER_TURN / weight` per turn
/// (stride scheduling); with weights up to
/// [`crate::config::MAX_TENANT_CPU_WEIGHT`] the rounding is under one part
/// in four million.
const VTIME_PER_TURN: u64 = 1 << 32;

/// One key's place in the scheduler: its virtual time and the turn it holds.
#[derive(Default)]
pub(crate) struct Seat {
    /// Slices granted to this key (its virtual time within its tenant).
    vtime: AtomicU64,
    /// The turn the key holds (0: none).
    turn: AtomicU64,
    /// Set while the key's callback waits for a turn (granted or not yet).
    waiting: AtomicBool,
}

/// The fair-share scheduler of one node's long callbacks (see the module
/// header).
pub(crate) struct Scheduler {
    /// Turns out at once at most: the number of guest threads.
    slices: usize,
    /// Each named tenant's weight; any other tenant's is 1.
    weights: HashMap<Arc<str>, u32>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Epoch ticks seen.
    tick: u64,
    next_turn: u64,
    /// Turns out: turn id → the tick it was granted at.
    out: BTreeMap<u64, u64>,
    /// Per tenant ("" on an open node), kept while the node runs (a tenant
    /// costs a few words).
    tenants: BTreeMap<Arc<str>, TenantQueue>,
    /// The tenant virtual time of the last turn granted.
    floor: u64,
}

struct TenantQueue {
    vtime: u64,
    /// What one turn adds to `vtime`: [`VTIME_PER_TURN`] over the weight.
    stride: u64,
    /// The key virtual time of this tenant's last turn.
    key_floor: u64,
    /// Waiting callbacks: (key virtual time, arrival) → waiter.
    waiting: BTreeMap<(u64, u64), Waiter>,
}

struct Waiter {
    seat: Arc<Seat>,
    granted: oneshot::Sender<()>,
}

impl Scheduler {
    /// A scheduler handing out at most `slices` turns at once, between
    /// tenants in proportion to `weights` (a tenant not named weighs 1; a
    /// weight is clamped to 1 ..= `MAX_TENANT_CPU_WEIGHT`).
    pub(crate) fn new(slices: usize, weights: HashMap<Arc<str>, u32>) -> Scheduler {
        Scheduler {
            slices: slices.max(1),
            weights,
            state: Mutex::new(State::default()),
        }
    }

    /// The queue of a tenant seen for the first time.
    fn new_queue(&self, tenant: &str) -> TenantQueue {
        let weight = self.weights.get(tenant).copied().unwrap_or(1);
        let weight = weight.clamp(1, crate::config::MAX_TENANT_CPU_WEIGHT);
        TenantQueue {
            vtime: 0,
            stride: VTIME_PER_TURN / u64::from(weight),
            key_floor: 0,
            waiting: BTreeMap::new(),
        }
    }

    /// Give back the turn `seat` holds, if any (its callback yielded or
    /// ended), and hand out what that frees.
    pub(crate) fn release(&self, seat: &Seat) {
        let turn = seat.turn.swap(0, Ordering::Relaxed);
        if turn == 0 {
            return;
        }
        let mut state = lock(&self.state);
        if state.out.remove(&turn).is_some() {
            self.grant(&mut state);
        }
    }

    /// The key's task went idle in a poll (`seat`'s owner): a turn it holds
    /// while not waiting for one means its callback waits on the host (an
    /// import, another key): give it back, it is not computing.
    pub(crate) fn release_if_blocked(&self, seat: &Seat) {
        if seat.turn.load(Ordering::Relaxed) != 0 && !seat.waiting.load(Ordering::Relaxed) {
            self.release(seat);
        }
    }

    /// Give back `seat`'s turn and wait for the next one (a yielding
    /// callback of `tenant`). The future is `'static`: it is the yield's.
    pub(crate) fn next_turn(
        self: &Arc<Self>,
        tenant: &Arc<str>,
        seat: &Arc<Seat>,
    ) -> impl Future<Output = ()> + Send + use<> {
        let (granted, wait) = oneshot::channel();
        {
            let turn = seat.turn.swap(0, Ordering::Relaxed);
            seat.waiting.store(true, Ordering::Relaxed);
            let mut state = lock(&self.state);
            if turn != 0 {
                state.out.remove(&turn);
            }
            let arrival = state.next_turn;
            state.next_turn += 1;
            let floor = state.floor;
            if !state.tenants.contains_key(tenant) {
                let queue = self.new_queue(tenant);
                state.tenants.insert(tenant.clone(), queue);
            }
            let queue = state.tenants.get_mut(tenant).expect("inserted above");
            if queue.waiting.is_empty() {
                // Back from idling: no banked credit.
                queue.vtime = queue.vtime.max(floor);
            }
            let vtime = seat.vtime.load(Ordering::Relaxed).max(queue.key_floor);
            seat.vtime.store(vtime, Ordering::Relaxed);
            queue.waiting.insert(
                (vtime, arrival),
                Waiter {
                    seat: seat.clone(),
                    granted,
                },
            );
            self.grant(&mut state);
        }
        let seat = seat.clone();
        async move {
            // Always let the worker run its other tasks first (a turn granted
            // at once would otherwise resume the guest without a yield).
            yield_once().await;
            // A dropped sender (the scheduler is gone) lets the key run on.
            let _ = wait.await;
            seat.waiting.store(false, Ordering::Relaxed);
        }
    }

    /// An epoch tick: reclaim turns [`TURN_RECLAIM_TICKS`] old, hand out
    /// what is free.
    pub(crate) fn tick(&self) {
        let mut state = lock(&self.state);
        state.tick += 1;
        let oldest = state.tick.saturating_sub(TURN_RECLAIM_TICKS);
        state.out.retain(|_, granted_at| *granted_at > oldest);
        self.grant(&mut state);
    }

    /// Turns out now (for tests).
    #[cfg(test)]
    fn out(&self) -> usize {
        lock(&self.state).out.len()
    }

    /// Hand out turns while some are free and someone waits: to the waiting
    /// tenant with the lowest virtual time, for its waiting key with the
    /// lowest.
    fn grant(&self, state: &mut State) {
        while state.out.len() < self.slices {
            let Some(queue) = state
                .tenants
                .iter_mut()
                .filter(|(_, q)| !q.waiting.is_empty())
                .min_by(|(a_name, a), (b_name, b)| (a.vtime, a_name).cmp(&(b.vtime, b_name)))
                .map(|(_, queue)| queue)
            else {
                return;
            };
            let Some(((key_vtime, _), waiter)) = queue.waiting.pop_first() else {
                return;
            };
            let tenant_vtime = queue.vtime;
            queue.vtime += queue.stride;
            queue.key_floor = key_vtime;
            state.floor = tenant_vtime;
            waiter.seat.vtime.store(key_vtime + 1, Ordering::Relaxed);
            let turn = state.next_turn;
            state.next_turn += 1;
            waiter.seat.turn.store(turn, Ordering::Relaxed);
            if waiter.granted.send(()).is_ok() {
                state.out.insert(turn, state.tick);
            } else {
                // Its callback was dropped (the key was killed).
                waiter.seat.turn.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// Pending once, waking itself at once (as wasmtime's own yield does):
/// the worker runs its other ready tasks, then this one again. Not tokio's
/// `yield_now`, which defers the wake until the worker next parks (measured:
/// about 20 ms per yield on an otherwise idle guest thread).
fn yield_once() -> impl Future<Output = ()> + Send {
    let mut yielded = false;
    std::future::poll_fn(move |cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
}

/// Turns granted per tenant, in order, for the tests below.
#[cfg(test)]
fn drain_order(
    scheduler: &Arc<Scheduler>,
    waiting: Vec<(Arc<str>, Arc<Seat>)>,
) -> std::collections::VecDeque<String> {
    use std::task::{Context, Poll};
    let mut pending: Vec<_> = waiting
        .into_iter()
        .map(|(tenant, seat)| {
            let fut = Box::pin(scheduler.next_turn(&tenant, &seat));
            (tenant, seat, fut)
        })
        .collect();
    let mut order = std::collections::VecDeque::new();
    let mut cx = Context::from_waker(std::task::Waker::noop());
    while !pending.is_empty() {
        // Each turn's future yields once before it looks at its grant.
        let ready = (0..2)
            .find_map(|_| {
                pending
                    .iter_mut()
                    .position(|(_, _, fut)| fut.as_mut().poll(&mut cx) == Poll::Ready(()))
            })
            .expect("someone holds a turn");
        let (tenant, seat, _) = pending.remove(ready);
        order.push_back(tenant.to_string());
        scheduler.release(&seat);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seats(tenant: &str, n: usize) -> Vec<(Arc<str>, Arc<Seat>)> {
        (0..n)
            .map(|_| (Arc::from(tenant), Arc::new(Seat::default())))
            .collect()
    }

    #[test]
    fn a_tenant_with_many_waiting_keys_gets_no_more_turns_than_one_with_one() {
        let scheduler = Arc::new(Scheduler::new(1, HashMap::new()));
        // Tenant `many` has 8 callbacks waiting, `few` 2, all arriving
        // before `few`'s: turns alternate between the tenants.
        let mut waiting = seats("many", 8);
        waiting.extend(seats("few", 2));
        let order = drain_order(&scheduler, waiting);
        let first_four: Vec<_> = order.iter().take(4).cloned().collect();
        assert_eq!(
            first_four.iter().filter(|t| *t == "few").count(),
            2,
            "turns: {order:?}"
        );
    }

    #[test]
    fn a_tenant_of_weight_three_gets_three_turns_to_one_of_weight_one() {
        let weights = HashMap::from([(Arc::from("gold"), 3)]);
        let scheduler = Arc::new(Scheduler::new(1, weights));
        // Both tenants keep 12 callbacks waiting; `bronze`'s arrive first.
        let mut waiting = seats("bronze", 12);
        waiting.extend(seats("gold", 12));
        let order = drain_order(&scheduler, waiting);
        let first: Vec<_> = order.iter().take(16).cloned().collect();
        let gold = first.iter().filter(|t| *t == "gold").count();
        assert_eq!(gold, 12, "of the first 16 turns gold got {gold}: {first:?}");
    }

    #[test]
    fn turns_out_never_exceed_the_slices_and_old_ones_are_reclaimed() {
        let scheduler = Arc::new(Scheduler::new(2, HashMap::new()));
        let waiting = seats("t", 4);
        let mut futures: Vec<_> = waiting
            .iter()
            .map(|(tenant, seat)| Some(Box::pin(scheduler.next_turn(tenant, seat))))
            .collect();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Each turn's future yields once before it looks at its grant: poll
        // twice.
        let mut poll_all = || {
            for _ in 0..2 {
                for slot in futures.iter_mut() {
                    if slot
                        .as_mut()
                        .is_some_and(|f| f.as_mut().poll(&mut cx).is_ready())
                    {
                        *slot = None;
                    }
                }
            }
            futures.iter().filter(|f| f.is_none()).count()
        };
        assert_eq!(poll_all(), 2);
        assert_eq!(scheduler.out(), 2);
        // The holders never give their turns back (dropped, say): after
        // TURN_RECLAIM_TICKS the other two run.
        for _ in 0..TURN_RECLAIM_TICKS {
            scheduler.tick();
        }
        assert_eq!(scheduler.out(), 2);
        assert_eq!(poll_all(), 4);
    }
}
