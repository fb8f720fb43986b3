//! The `fief:key/host` imports: what a key process may ask of its node.
//!
//! Every import with an effect passes the side-effect gate
//! ([`KeyCtx::gate`]) first: once the key is killed or its node has fenced,
//! the import has no effect and traps the guest (contract §2, "every host
//! import that causes a side effect checks the fence first"). Expected
//! failures — a full mailbox, an unknown module, a limit — are WIT `result`s
//! the guest can handle; traps are reserved for refusals and kills.
//!
//! A tenant's key lives inside its tenant ([`crate::auth`]): the modules
//! it calls and casts to, its topics and its cache namespaces are resolved
//! as `tenant/name`, so it can neither reach nor overhear another tenant.

use std::time::Duration;

use crate::auth::{guest_module, guest_scoped};
use crate::bindings::host::Host;
use crate::bindings::types::{self, CacheError, CallError, EffectError, LogLevel};
use crate::cache::{CacheOp, CacheOutcome, Expect, unexpected_outcome};
use crate::error::Error;
use crate::key::{KeyCtx, arm_timer};
use crate::pubsub::MAX_TOPIC_BYTES;

impl types::Host for KeyCtx {}

impl KeyCtx {
    fn check_topic(topic: &str) -> Result<(), EffectError> {
        if topic.is_empty() || topic.len() > MAX_TOPIC_BYTES {
            return Err(EffectError::Invalid(format!(
                "a topic is 1 to {MAX_TOPIC_BYTES} bytes long"
            )));
        }
        Ok(())
    }
}

impl Host for KeyCtx {
    fn self_key(&mut self) -> wasmtime::Result<String> {
        Ok(self.env.key.to_string())
    }

    fn self_module(&mut self) -> wasmtime::Result<String> {
        Ok(self.env.module.to_string())
    }

    fn ownership_token(&mut self) -> wasmtime::Result<u64> {
        Ok(self.env.token.0)
    }

    fn send_after(
        &mut self,
        delay_ms: u64,
        tag: Vec<u8>,
    ) -> wasmtime::Result<Result<u64, EffectError>> {
        let node = self.gate()?;
        if self.timers.len() >= self.env.max_timers as usize {
            return Ok(Err(EffectError::Limit(format!(
                "this key already has {} timers armed (max_timers_per_key)",
                self.timers.len()
            ))));
        }
        let limit = node.config.max_message_size.as_u64() as usize;
        if tag.len() > limit {
            return Ok(Err(EffectError::Invalid(format!(
                "a timer tag is at most {limit} bytes (max_message_size)"
            ))));
        }
        Ok(Ok(arm_timer(self, Duration::from_millis(delay_ms), tag)))
    }

    fn cancel_timer(&mut self, id: u64) -> wasmtime::Result<bool> {
        Ok(match self.timers.remove(&id) {
            Some(timer) => {
                timer.abort();
                true
            }
            None => false,
        })
    }

    fn subscribe(&mut self, topic: String) -> wasmtime::Result<Result<(), EffectError>> {
        let node = self.gate()?;
        if let Err(e) = Self::check_topic(&topic) {
            return Ok(Err(e));
        }
        let topic = guest_scoped(&self.env.module, &topic);
        if self.subscriptions.contains(&topic) {
            return Ok(Ok(()));
        }
        if self.subscriptions.len() >= self.env.max_subscriptions as usize {
            return Ok(Err(EffectError::Limit(format!(
                "this key already has {} subscriptions (max_subscriptions_per_key)",
                self.subscriptions.len()
            ))));
        }
        node.pubsub.subscribe(
            &topic,
            &self.env.module,
            &self.env.key,
            self.env.generation,
            self.env.mailbox.clone(),
        );
        self.subscriptions.insert(topic);
        Ok(Ok(()))
    }

    fn unsubscribe(&mut self, topic: String) -> wasmtime::Result<()> {
        let topic = guest_scoped(&self.env.module, &topic);
        if self.subscriptions.remove(&topic)
            && let Some(node) = self.env.node.upgrade()
        {
            node.pubsub
                .unsubscribe(&topic, &self.env.module, &self.env.key, self.env.generation);
        }
        Ok(())
    }

    fn publish(
        &mut self,
        topic: String,
        payload: Vec<u8>,
    ) -> wasmtime::Result<Result<u32, EffectError>> {
        let node = self.gate()?;
        if let Err(e) = Self::check_topic(&topic) {
            return Ok(Err(e));
        }
        let topic = guest_scoped(&self.env.module, &topic);
        let limit = node.config.max_message_size.as_u64() as usize;
        if payload.len() > limit {
            return Ok(Err(EffectError::Invalid(format!(
                "a payload of {} bytes is over max_message_size ({limit} bytes)",
                payload.len()
            ))));
        }
        if let Err(why) = self.publishes.take(node.clock.now()) {
            return Ok(Err(EffectError::Limit(why)));
        }
        Ok(Ok(node.pubsub.publish(&topic, &payload)))
    }

    async fn call(
        &mut self,
        module: String,
        key: String,
        message: Vec<u8>,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<Vec<u8>, CallError>> {
        let node = self.gate()?;
        let module = match guest_module(&self.env.module, &module) {
            Ok(module) => module,
            Err(e) => return Ok(Err(call_error(e))),
        };
        if module == *self.env.module && key == *self.env.key {
            return Ok(Err(CallError::Deadlock));
        }
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        let result = node
            .call_with_timeout(&module, &key, message, timeout)
            .await;
        // The world may have changed while this key waited.
        self.gate()?;
        Ok(result.map_err(call_error))
    }

    fn cast(
        &mut self,
        module: String,
        key: String,
        message: Vec<u8>,
    ) -> wasmtime::Result<Result<(), EffectError>> {
        let node = self.gate()?;
        let module = guest_module(&self.env.module, &module);
        Ok(module
            .and_then(|module| node.cast(&module, &key, message))
            .map_err(|e| match e {
                Error::UnknownModule(m) => EffectError::UnknownModule(m),
                Error::Overloaded { .. } | Error::TooManyKeys { .. } | Error::PoolFull { .. } => {
                    EffectError::Overloaded
                }
                other => EffectError::Invalid(other.to_string()),
            }))
    }

    async fn cache_get(
        &mut self,
        namespace: String,
        key: String,
    ) -> wasmtime::Result<Result<Option<types::CacheEntry>, CacheError>> {
        let node = self.gate()?;
        let namespace = match guest_cache_namespace(&self.env.module, &namespace) {
            Ok(namespace) => namespace,
            Err(e) => return Ok(Err(cache_error(e))),
        };
        let op = CacheOp::Get { namespace, key };
        let outcome = node.cache_op(op).await;
        self.gate()?;
        Ok(outcome
            .and_then(|o| match o {
                CacheOutcome::Found(entry) => Ok(entry.map(|e| types::CacheEntry {
                    value: e.value,
                    version: e.version,
                })),
                other => Err(unexpected_outcome(&other)),
            })
            .map_err(cache_error))
    }

    async fn cache_put(
        &mut self,
        namespace: String,
        key: String,
        value: Vec<u8>,
        ttl_ms: Option<u64>,
        expected_version: Option<u64>,
    ) -> wasmtime::Result<Result<u64, CacheError>> {
        let node = self.gate()?;
        if let Err(e) = node.check_message(&value) {
            return Ok(Err(cache_error(e)));
        }
        let namespace = match guest_cache_namespace(&self.env.module, &namespace) {
            Ok(namespace) => namespace,
            Err(e) => return Ok(Err(cache_error(e))),
        };
        let op = CacheOp::Put {
            namespace,
            key,
            value,
            ttl_ms: ttl_ms.map(|ms| ms.max(1)),
            expect: expectation(expected_version),
        };
        let outcome = node.cache_op(op).await;
        self.gate()?;
        Ok(outcome
            .and_then(|o| match o {
                CacheOutcome::Written { version } => Ok(version),
                CacheOutcome::Conflict { current } => Err(Error::VersionConflict { current }),
                other => Err(unexpected_outcome(&other)),
            })
            .map_err(cache_error))
    }

    async fn cache_delete(
        &mut self,
        namespace: String,
        key: String,
        expected_version: Option<u64>,
    ) -> wasmtime::Result<Result<bool, CacheError>> {
        let node = self.gate()?;
        let namespace = match guest_cache_namespace(&self.env.module, &namespace) {
            Ok(namespace) => namespace,
            Err(e) => return Ok(Err(cache_error(e))),
        };
        let op = CacheOp::Delete {
            namespace,
            key,
            expect: expectation(expected_version),
        };
        let outcome = node.cache_op(op).await;
        self.gate()?;
        Ok(outcome
            .and_then(|o| match o {
                CacheOutcome::Deleted(existed) => Ok(existed),
                CacheOutcome::Conflict { current } => Err(Error::VersionConflict { current }),
                other => Err(unexpected_outcome(&other)),
            })
            .map_err(cache_error))
    }

    fn log(&mut self, level: LogLevel, message: String) -> wasmtime::Result<()> {
        self.gate()?;
        let (module, key) = (&*self.env.module, &*self.env.key);
        match level {
            LogLevel::Trace => tracing::trace!(target: "fief::guest", module, key, "{message}"),
            LogLevel::Debug => tracing::debug!(target: "fief::guest", module, key, "{message}"),
            LogLevel::Info => tracing::info!(target: "fief::guest", module, key, "{message}"),
            LogLevel::Warn => tracing::warn!(target: "fief::guest", module, key, "{message}"),
            LogLevel::Error => tracing::error!(target: "fief::guest", module, key, "{message}"),
        }
        Ok(())
    }
}

/// The WIT's `expected-version` (0: no entry) as a precondition.
fn expectation(expected_version: Option<u64>) -> Expect {
    match expected_version {
        None => Expect::Any,
        Some(0) => Expect::Absent,
        Some(v) => Expect::Version(v),
    }
}

/// Map a node error to what a guest using the cache sees.
/// The cache namespace a guest of `module` names, inside its tenant if it
/// has one. `/` is refused: it separates a tenant from its namespaces, so a
/// guest naming `other/ns` could otherwise reach another tenant's entries.
fn guest_cache_namespace(module: &str, namespace: &str) -> Result<String, Error> {
    if namespace.contains('/') {
        return Err(Error::InvalidKey(format!(
            "cache namespace {namespace:?} must not contain '/': a key names namespaces of its \
             own tenant, without the tenant"
        )));
    }
    Ok(guest_scoped(module, namespace))
}

fn cache_error(error: Error) -> CacheError {
    match error {
        Error::VersionConflict { current } => CacheError::Conflict(current),
        Error::InvalidKey(_) | Error::MessageTooLarge { .. } | Error::CacheEntryTooLarge { .. } => {
            CacheError::Invalid(error.to_string())
        }
        other => CacheError::Unavailable(other.to_string()),
    }
}

/// Map a node error to what a calling guest sees.
fn call_error(error: Error) -> CallError {
    match error {
        Error::UnknownModule(m) => CallError::UnknownModule(m),
        Error::InvalidKey(_) | Error::InvalidModuleName { .. } | Error::MessageTooLarge { .. } => {
            CallError::Invalid(error.to_string())
        }
        Error::Fenced => CallError::Fenced,
        Error::Overloaded { .. } | Error::TooManyKeys { .. } | Error::PoolFull { .. } => {
            CallError::Overloaded
        }
        Error::Deadlock => CallError::Deadlock,
        Error::Rejected(why) => CallError::Rejected(why),
        Error::KeyDied(why) | Error::InitRefused(why) => CallError::Crashed(why),
        other => CallError::Unavailable(other.to_string()),
    }
}
