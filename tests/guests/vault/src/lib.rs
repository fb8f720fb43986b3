//! `vault`: a test guest for durable state (`fief:key/storage`), driven by
//! text commands (words separated by spaces; `-` stands for "none").
//!
//! Calls answer with the result, or `err:<kind>:<message>` when storage
//! refused (kinds: `invalid`, `limit`, `unavailable`), so tests can see
//! each refusal:
//!
//! | call                                   | does                                       | answers            |
//! |----------------------------------------|--------------------------------------------|--------------------|
//! | `put N V`                              | stores `V` under `N`                       | `ok`               |
//! | `get N`                                | reads `N`                                  | the value, or `-`  |
//! | `get-import N`                         | reads `N` through the import, not the SDK's read cache | the value, or `-`  |
//! | `cache-limit BYTES`                    | bounds the SDK's read cache (0: off)       | `ok`               |
//! | `del N`                                | deletes `N`                                | `true` / `false`   |
//! | `list START END LIMIT`                 | lists (`END` may be `-`)                   | `n=v` lines        |
//! | `delrange START END`                   | deletes a range                            | how many           |
//! | `incr`                                 | adds one to `n`                            | the new value      |
//! | `big N BYTES`                          | stores `BYTES` bytes under `N`             | `ok`               |
//! | `many COUNT`                           | `COUNT` puts `m0`, `m1`, … in one callback | `ok`               |
//! | `put-trap N V`                         | stores, then traps (nothing is committed)  | —                  |
//! | `put-cast N V MODULE KEY MESSAGE...`   | stores, then casts (the rest is the message) | `ok`               |
//! | `put-publish N V TOPIC PAYLOAD`        | stores, then publishes                     | subscriber count   |
//! | `put-timer N V MS`                     | stores, then arms a timer tagged `V`       | `ok`               |
//! | `put-call N V MODULE KEY MESSAGE...`   | stores, then calls (the rest is the message) | the callee's reply |
//! | `subscribe TOPIC`                      | subscribes                                 | `ok`               |
//! | `token`                                | the ownership token                        | decimal            |
//!
//! A cast `put N V` stores too. A fired timer stores its tag under `timer`,
//! a publication its payload under `pub`. `terminate` stores its reason
//! under `stopped` when `record-stops` is stored.

use fief_guest::{Info, Key, StopReason, StorageError, export_key, host, storage};

/// One vault key; everything it keeps is in storage.
struct Vault;

fn refusal(e: StorageError) -> String {
    match e {
        StorageError::Invalid(m) => format!("err:invalid:{m}"),
        StorageError::Limit(m) => format!("err:limit:{m}"),
        StorageError::Unavailable(m) => format!("err:unavailable:{m}"),
    }
}

fn end(word: &str) -> Option<&str> {
    (word != "-").then_some(word)
}

/// Run one command; storage refusals become `err:` answers.
fn run(words: &[&str]) -> Result<String, StorageError> {
    Ok(match words {
        ["put", name, value] => {
            storage::put(name, value.as_bytes())?;
            "ok".to_owned()
        }
        ["get", name] => match storage::get(name)? {
            Some(value) => String::from_utf8_lossy(&value).into_owned(),
            None => "-".to_owned(),
        },
        ["get-import", name] => {
            match fief_guest::__private::bindings::fief::key::storage::get(name)? {
                Some(value) => String::from_utf8_lossy(&value).into_owned(),
                None => "-".to_owned(),
            }
        }
        ["cache-limit", bytes] => {
            storage::set_read_cache_limit(bytes.parse().unwrap_or(0));
            "ok".to_owned()
        }
        ["del", name] => storage::delete(name)?.to_string(),
        ["list", start, stop, limit] => {
            storage::list(start, end(stop), limit.parse().unwrap_or(0))?
                .into_iter()
                .map(|(n, v)| format!("{n}={}", String::from_utf8_lossy(&v)))
                .collect::<Vec<_>>()
                .join("\n")
        }
        ["delrange", start, stop] => storage::delete_range(start, end(stop))?.to_string(),
        ["incr"] => {
            let n: u64 = storage::get("n")?
                .and_then(|v| String::from_utf8(v).ok()?.parse().ok())
                .unwrap_or(0)
                + 1;
            storage::put("n", n.to_string().as_bytes())?;
            n.to_string()
        }
        ["big", name, bytes] => {
            storage::put(name, &vec![b'x'; bytes.parse().unwrap_or(0)])?;
            "ok".to_owned()
        }
        ["many", count] => {
            for i in 0..count.parse::<u32>().unwrap_or(0) {
                storage::put(&format!("m{i}"), b"1")?;
            }
            "ok".to_owned()
        }
        ["put-trap", name, value] => {
            storage::put(name, value.as_bytes())?;
            panic!("vault: trapping after a put, as asked");
        }
        ["put-cast", name, value, module, key, message @ ..] => {
            storage::put(name, value.as_bytes())?;
            match host::cast(module, key, message.join(" ").as_bytes()) {
                Ok(()) => "ok".to_owned(),
                Err(e) => format!("err:cast:{e:?}"),
            }
        }
        ["put-publish", name, value, topic, payload] => {
            storage::put(name, value.as_bytes())?;
            match host::publish(topic, payload.as_bytes()) {
                Ok(n) => n.to_string(),
                Err(e) => format!("err:publish:{e:?}"),
            }
        }
        ["put-timer", name, value, ms] => {
            storage::put(name, value.as_bytes())?;
            let delay = core::time::Duration::from_millis(ms.parse().unwrap_or(0));
            match host::send_after(delay, value.as_bytes()) {
                Ok(_) => "ok".to_owned(),
                Err(e) => format!("err:timer:{e:?}"),
            }
        }
        ["put-call", name, value, module, key, message @ ..] => {
            storage::put(name, value.as_bytes())?;
            let timeout = core::time::Duration::from_secs(5);
            match host::call(module, key, message.join(" ").as_bytes(), timeout) {
                Ok(reply) => String::from_utf8_lossy(&reply).into_owned(),
                Err(e) => format!("err:call:{e:?}"),
            }
        }
        ["subscribe", topic] => match host::subscribe(topic) {
            Ok(()) => "ok".to_owned(),
            Err(e) => format!("err:subscribe:{e:?}"),
        },
        ["token"] => host::ownership_token().to_string(),
        other => format!("err:command:unknown command {other:?}"),
    })
}

impl Key for Vault {
    fn init(_key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        Ok(Vault)
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let text = String::from_utf8_lossy(&message).into_owned();
        let words: Vec<&str> = text.split(' ').collect();
        Ok(run(&words).unwrap_or_else(refusal).into_bytes())
    }

    fn handle_cast(&mut self, message: Vec<u8>) {
        let text = String::from_utf8_lossy(&message).into_owned();
        let words: Vec<&str> = text.split(' ').collect();
        if let Err(e) = run(&words) {
            host::log::warn(&format!("vault: cast {text:?}: {}", refusal(e)));
        }
    }

    fn handle_info(&mut self, info: Info) {
        let result = match info {
            Info::Timer(fired) => storage::put("timer", &fired.tag),
            Info::Published(publication) => storage::put("pub", &publication.payload),
        };
        if let Err(e) = result {
            host::log::warn(&format!("vault: info: {}", refusal(e)));
        }
    }

    fn terminate(&mut self, reason: StopReason) {
        if matches!(storage::get("record-stops"), Ok(Some(_))) {
            let _ = storage::put("stopped", format!("{reason:?}").as_bytes());
        }
    }
}

export_key!(Vault);
