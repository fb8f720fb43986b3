//! A tokio runtime on an OS thread of its own, for work whose timing must not
//! depend on how busy the node's shared runtime is.
//!
//! The node's runtime runs guest code: every running key is a task that
//! yields at each epoch tick, and a worker that never parks polls its timers
//! and sockets only between task polls. Whatever must keep time under that
//! load runs on a [`DedicatedRuntime`] instead: the coordination loop (lease
//! renewal, the fence timer; `node/coordination.rs`) and the PostgreSQL arbiter's
//! connections and statements (`arbiter/postgres/`). A thread that sleeps
//! most of the time is also what the OS scheduler wakes first when the
//! cores are busy.
//!
//! This module owns the thread's life: it runs one root future on a
//! current-thread runtime, which also runs whatever is spawned on it (see
//! [`DedicatedRuntime::handle`]), until the root ends or the owner stops it;
//! then it drops the runtime, and its tasks, on the thread itself and ends.
//! Dropping the owner stops it too, so no thread outlives its owner for long.

use std::future::Future;
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::watch;

/// How long [`DedicatedRuntime::stop`] waits for the thread to finish before
/// it lets it finish on its own.
const STOP_WAIT: Duration = Duration::from_secs(2);

/// A current-thread runtime on a thread of its own, running one root future.
pub(crate) struct DedicatedRuntime {
    handle: Handle,
    name: String,
    /// Set to stop the root; dropping it stops the root too.
    stop: watch::Sender<bool>,
    /// Disconnects when the thread has dropped its runtime and is ending.
    ended: Mutex<mpsc::Receiver<()>>,
}

impl DedicatedRuntime {
    /// Start thread `name` and run the future `root` makes there (it is made
    /// on the thread, inside the runtime) until it ends or [`stop`] is called.
    ///
    /// # Errors
    ///
    /// The OS refused a thread, or the runtime could not be built.
    ///
    /// [`stop`]: DedicatedRuntime::stop
    pub(crate) fn start<F, R>(name: &str, root: F) -> std::io::Result<DedicatedRuntime>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Future<Output = ()> + 'static,
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, mut stopped) = watch::channel(false);
        let (ending, ended) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                // Dropped last, even if the root panics: `stop` waits for it.
                let _ending = ending;
                runtime.block_on(async move {
                    tokio::select! {
                        biased;
                        _ = stopped.wait_for(|stop| *stop) => {}
                        () = root() => {}
                    }
                });
                // The root is gone; the runtime and whatever still runs on it
                // are dropped here, outside any runtime context.
                drop(runtime);
            })?;
        Ok(DedicatedRuntime {
            handle,
            name: name.to_owned(),
            stop,
            ended: Mutex::new(ended),
        })
    }

    /// The runtime's handle, to spawn onto it (tasks end with the thread).
    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Stop the root future, and wait (briefly) until the thread has dropped
    /// it and its runtime: once this returns, nothing of the root runs any
    /// more — unless the root is stuck in a blocking call, in which case the
    /// thread is left to end when the call returns. Idempotent.
    pub(crate) fn stop(&self) {
        self.stop.send_replace(true);
        let ended = self
            .ended
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(mpsc::RecvTimeoutError::Timeout) = ended.recv_timeout(STOP_WAIT) {
            tracing::warn!(
                thread = %self.name,
                "a dedicated runtime's thread did not stop within {STOP_WAIT:?}; it ends on its own"
            );
        }
    }
}

impl Drop for DedicatedRuntime {
    fn drop(&mut self) {
        // Without waiting: the thread ends as soon as it sees it.
        self.stop.send_replace(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Sets a flag when dropped.
    struct Dropped(Arc<AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn stop_drops_the_root_and_what_was_spawned_before_it_returns() {
        let (root_dropped, task_dropped) = (Arc::default(), Arc::new(AtomicBool::new(false)));
        let flag = Dropped(Arc::clone(&root_dropped));
        let dedicated = DedicatedRuntime::start("fief-test", move || async move {
            let _flag = flag;
            std::future::pending::<()>().await;
        })
        .unwrap();
        let spawned = Dropped(task_dropped.clone());
        dedicated.handle().spawn(async move {
            let _spawned = spawned;
            std::future::pending::<()>().await;
        });
        dedicated.stop();
        assert!(root_dropped.load(Ordering::SeqCst));
        assert!(task_dropped.load(Ordering::SeqCst));
        dedicated.stop();
    }

    #[test]
    fn timers_run_on_the_thread_while_the_caller_blocks() {
        let (tx, rx) = mpsc::channel();
        let _dedicated = DedicatedRuntime::start("fief-test", move || async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            tx.send(std::thread::current().name().map(str::to_owned))
                .unwrap();
        })
        .unwrap();
        let name = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(name.as_deref(), Some("fief-test"));
    }

    #[test]
    fn dropping_it_ends_the_thread() {
        let root_dropped = Arc::new(AtomicBool::new(false));
        let flag = Dropped(root_dropped.clone());
        let dedicated = DedicatedRuntime::start("fief-test", move || async move {
            let _flag = flag;
            std::future::pending::<()>().await;
        })
        .unwrap();
        drop(dedicated);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !root_dropped.load(Ordering::SeqCst) {
            assert!(std::time::Instant::now() < deadline, "the root was dropped");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
