//! `probe`: a test guest that exercises every host import and lifecycle
//! export, so that host tests can drive each one and observe the result.
//!
//! Every behaviour is a UTF-8 text command sent with `handle-call`:
//!
//! | command                        | reply                                            |
//! |--------------------------------|--------------------------------------------------|
//! | `ping`                         | `pong`                                           |
//! | `whoami`                       | `<module>/<key>` (`self-module`, `self-key`)     |
//! | `token`                        | the ownership token, decimal                     |
//! | `echo <text>`                  | `<text>`                                         |
//! | `size <n>`                     | `n` bytes of `x`                                 |
//! | `call <module> <key> <msg...>` | the callee's reply (5 s timeout), or `error: <CallError>` |
//! | `cast <module> <key> <msg...>` | `ok`, or `error: <EffectError>`                  |
//! | `publish <topic> <payload...>` | the delivered count, or `error: ...`             |
//! | `subscribe <topic>`            | `ok`, or `error: ...`                            |
//! | `unsubscribe <topic>`          | `ok`                                             |
//! | `after <ms> <tag>`             | the armed timer's id, or `error: ...`            |
//! | `cancel <id>`                  | `true` if the timer had not fired, else `false`  |
//! | `log <text>`                   | `ok`, after logging `<text>` at info level       |
//! | `print <text>`                 | `ok`, after `println!` to the guest's stdout     |
//! | `events`                       | every event so far, one per line, in order       |
//! | `log-events`                   | `ok`; from now on each event is also logged (`probe event <event>`, info) |
//! | `fail <text>`                  | the error `<text>` (`call-error.rejected`)       |
//! | `init-state`                   | the handoff state `init` got (lossy UTF-8), or `none` |
//! | `on-fence continue` / `on-fence stop` | `ok`; sets the answer to `handle-fence`   |
//! | `panic`                        | none: the guest panics (the process traps)       |
//! | `cache-get <ns> <key>`         | `<version> <value>`, `none`, or `error: ...`     |
//! | `cache-put <ns> <key> <value>` | the new version, or `error: ...`                 |
//! | `cache-cas <ns> <key> <version> <value>` | as `cache-put`, only if the version matches (0: if absent) |
//! | `cache-delete <ns> <key>`      | `true` if there was an entry, else `false`       |
//!
//! Events recorded, in the order they arrive: each cast as `cast:<msg>`
//! (so cast `record <text>` records `cast:record <text>`), each fired timer as
//! `timer:<tag>`, each publication as `pub:<topic>:<payload>`, and each
//! `handle-fence` as `fence:<deadline-ms>`.
//!
//! WebSocket connections (`GET /v1/keys/probe/<key>/connect`): every text
//! frame is sent back as a text frame to the connection it came from, every
//! binary frame as a binary frame (an echo; `benches/benches/realtime.rs`'s
//! `echo` drives it); opens and closes are accepted. Nothing is recorded:
//! connection events never appear in `events`.
//!
//! Other lifecycle behaviour: `init` refuses keys starting with `refuse-`;
//! `handle-fence` answers `stop` unless told otherwise; `handoff` returns
//! `probe-handoff:<number of events>`; `terminate` records nothing (the
//! process is going away) but logs `terminate: <reason:?>` at info level.
//!
//! Host effect errors are replies (`error: ...`), not call errors, so a test
//! can tell "the host refused" from "the guest refused".

use core::time::Duration;

use fief_guest::cache::{self, Write};
use fief_guest::connections::{self, Event};
use fief_guest::{FenceDecision, Info, Key, StopReason, TimerId, export_key, host};

/// Timeout of the `call` command.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The probe's state.
struct Probe {
    /// What `init` got as handoff state.
    init_state: Option<Vec<u8>>,
    /// Everything recorded so far, oldest first.
    events: Vec<String>,
    /// The answer to the next `handle-fence`.
    fence_answer: FenceAnswer,
    /// Whether each event is also logged (`log-events`), so a test can see
    /// when a process got it from the node's log, even after the process
    /// is gone.
    log_events: bool,
}

/// How `handle-fence` answers.
#[derive(Clone, Copy)]
enum FenceAnswer {
    /// `fence-decision.continue`.
    Continue,
    /// `fence-decision.stop`.
    Stop,
}

/// Splits `text` at its first space: `(word, rest)`; `rest` is empty if there
/// is no space.
fn split_word(text: &str) -> (&str, &str) {
    text.split_once(' ').unwrap_or((text, ""))
}

/// Splits `<module> <key> <msg...>`.
fn split_target(args: &str) -> Result<(&str, &str, &str), String> {
    let (module, rest) = split_word(args);
    let (key, message) = split_word(rest);
    if module.is_empty() || key.is_empty() {
        return Err(format!(
            "probe: expected <module> <key> <msg...>, got {args:?}"
        ));
    }
    Ok((module, key, message))
}

/// The reply for a host effect's outcome: `ok` text or `error: <e>`.
fn reply_or_error<T, E: core::fmt::Display>(
    result: Result<T, E>,
    ok: impl FnOnce(T) -> String,
) -> String {
    match result {
        Ok(value) => ok(value),
        Err(error) => format!("error: {error}"),
    }
}

impl Probe {
    /// Record `event` (and log it, after `log-events`).
    fn record(&mut self, event: String) {
        if self.log_events {
            host::log::info(&format!("probe event {event}"));
        }
        self.events.push(event);
    }

    /// Runs one `handle-call` command; returns the reply text.
    fn command(&mut self, text: &str) -> Result<String, String> {
        let (command, args) = split_word(text);
        let reply = match command {
            "ping" => "pong".to_owned(),
            "whoami" => format!("{}/{}", host::self_module(), host::self_key()),
            "token" => host::ownership_token().to_string(),
            "echo" => args.to_owned(),
            "size" => {
                let n: usize = args
                    .parse()
                    .map_err(|_| format!("probe: size needs a byte count, got {args:?}"))?;
                "x".repeat(n)
            }
            "call" => {
                let (module, key, message) = split_target(args)?;
                match host::call(module, key, message.as_bytes(), CALL_TIMEOUT) {
                    Ok(reply) => String::from_utf8_lossy(&reply).into_owned(),
                    Err(error) => format!("error: {error}"),
                }
            }
            "cast" => {
                let (module, key, message) = split_target(args)?;
                reply_or_error(host::cast(module, key, message.as_bytes()), |()| {
                    "ok".to_owned()
                })
            }
            "publish" => {
                let (topic, payload) = split_word(args);
                reply_or_error(host::publish(topic, payload.as_bytes()), |delivered| {
                    delivered.to_string()
                })
            }
            "subscribe" => reply_or_error(host::subscribe(args), |()| "ok".to_owned()),
            "unsubscribe" => {
                host::unsubscribe(args);
                "ok".to_owned()
            }
            "after" => {
                let (ms, tag) = split_word(args);
                let ms: u64 = ms
                    .parse()
                    .map_err(|_| format!("probe: after needs milliseconds, got {ms:?}"))?;
                reply_or_error(
                    host::send_after(Duration::from_millis(ms), tag.as_bytes()),
                    |id| id.to_string(),
                )
            }
            "cancel" => {
                let id: TimerId = args
                    .parse()
                    .map_err(|_| format!("probe: cancel needs a timer id, got {args:?}"))?;
                host::cancel_timer(id).to_string()
            }
            "log" => {
                host::log::info(args);
                "ok".to_owned()
            }
            "log-events" => {
                self.log_events = true;
                "ok".to_owned()
            }
            "print" => {
                println!("{args}");
                "ok".to_owned()
            }
            "events" => self.events.join("\n"),
            "fail" => return Err(args.to_owned()),
            "init-state" => match &self.init_state {
                Some(state) => String::from_utf8_lossy(state).into_owned(),
                None => "none".to_owned(),
            },
            "on-fence" => {
                self.fence_answer = match args {
                    "continue" => FenceAnswer::Continue,
                    "stop" => FenceAnswer::Stop,
                    _ => return Err(format!("probe: on-fence continue|stop, got {args:?}")),
                };
                "ok".to_owned()
            }
            "panic" => panic!("probe: panic requested"),
            "cache-get" => {
                let (namespace, key) = split_word(args);
                reply_or_error(cache::get(namespace, key), |entry| match entry {
                    Some(entry) => format!(
                        "{} {}",
                        entry.version,
                        String::from_utf8_lossy(&entry.value)
                    ),
                    None => "none".to_owned(),
                })
            }
            "cache-put" => {
                let (namespace, rest) = split_word(args);
                let (key, value) = split_word(rest);
                let written = cache::put(namespace, key, value.as_bytes(), None, Write::Always);
                reply_or_error(written, |version| version.to_string())
            }
            "cache-cas" => {
                let (namespace, rest) = split_word(args);
                let (key, rest) = split_word(rest);
                let (version, value) = split_word(rest);
                let version: u64 = version
                    .parse()
                    .map_err(|_| format!("probe: cache-cas needs a version, got {version:?}"))?;
                let write = match version {
                    0 => Write::IfAbsent,
                    v => Write::IfVersion(v),
                };
                let written = cache::put(namespace, key, value.as_bytes(), None, write);
                reply_or_error(written, |version| version.to_string())
            }
            "cache-delete" => {
                let (namespace, key) = split_word(args);
                reply_or_error(cache::delete(namespace, key, Write::Always), |existed| {
                    existed.to_string()
                })
            }
            _ => return Err(format!("probe: unknown command {text:?}")),
        };
        Ok(reply)
    }
}

impl Key for Probe {
    fn init(key: &str, handoff: Option<Vec<u8>>) -> Result<Self, String> {
        if key.starts_with("refuse-") {
            return Err(format!("probe: refusing key {key}"));
        }
        Ok(Probe {
            init_state: handoff,
            events: Vec::new(),
            fence_answer: FenceAnswer::Stop,
            log_events: false,
        })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let text = String::from_utf8_lossy(&message);
        self.command(&text).map(String::into_bytes)
    }

    fn handle_cast(&mut self, message: Vec<u8>) {
        self.record(format!("cast:{}", String::from_utf8_lossy(&message)));
    }

    fn handle_info(&mut self, info: Info) {
        let event = match info {
            Info::Timer(fired) => format!("timer:{}", String::from_utf8_lossy(&fired.tag)),
            Info::Published(publication) => format!(
                "pub:{}:{}",
                publication.topic,
                String::from_utf8_lossy(&publication.payload)
            ),
        };
        self.record(event);
    }

    fn handle_connection(&mut self, event: Event) {
        // An echo; a send the host refuses (a full queue, a closed
        // connection) is dropped, as an echo server would.
        match event {
            Event::Text { id, text } => {
                let _ = connections::send_text(id, &text);
            }
            Event::Binary { id, data } => {
                let _ = connections::send_binary(id, &data);
            }
            Event::Opened { .. } | Event::Closed { .. } => {}
        }
    }

    fn handle_fence(&mut self, deadline_ms: u32) -> FenceDecision {
        self.events.push(format!("fence:{deadline_ms}"));
        match self.fence_answer {
            FenceAnswer::Continue => FenceDecision::Continue,
            FenceAnswer::Stop => FenceDecision::Stop("probe: told to stop on fence".into()),
        }
    }

    fn handoff(&mut self) -> Option<Vec<u8>> {
        Some(format!("probe-handoff:{}", self.events.len()).into_bytes())
    }

    fn terminate(&mut self, reason: StopReason) {
        host::log::info(&format!("terminate: {reason:?}"));
    }
}

export_key!(Probe);
