//! What a failing test shows last. Fixtures that run processes (nodes, etcd
//! members) print their logs' tails while a failing test unwinds; those
//! lines come after the panic message, and a report that keeps only the end
//! of a test's output (CI's does) would show logs and hide why the test
//! failed. This module keeps each thread's last panic message so a fixture
//! can end its dump by repeating it.
//!
//! It owns one process-wide panic hook, installed once, that records the
//! message and then runs the hook it replaced (so libtest's own report is
//! unchanged). It must not decide anything about a test's outcome.

use std::cell::RefCell;
use std::sync::Once;

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Install the hook that keeps panic messages (once per process; later
/// calls do nothing). Fixtures that print logs on a panic call it when they
/// start.
pub fn keep_panic_messages() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info.to_string();
            LAST_PANIC.with(|last| *last.borrow_mut() = Some(message));
            previous(info);
        }));
    });
}

/// The line a fixture prints after its logs while this thread unwinds:
/// the panic that failed the test, as the hook kept it.
pub fn why_the_test_failed() -> String {
    let message = LAST_PANIC.with(|last| last.borrow().clone());
    format!(
        "---- the test failed (repeated after the logs above): {}",
        message.unwrap_or_else(|| "a panic before its message was kept".to_owned())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_of_a_panic_is_repeated_after_the_logs() {
        keep_panic_messages();
        let unwound = std::panic::catch_unwind(|| {
            panic!("no node fences while etcd elects a leader");
        });
        assert!(unwound.is_err());
        let line = why_the_test_failed();
        assert!(
            line.contains("no node fences while etcd elects a leader"),
            "{line}"
        );
    }
}
