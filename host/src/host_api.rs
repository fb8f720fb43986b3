//! The `fief:key/host` imports: what a key process may ask of its node.
//!
//! Every import with an effect passes the side-effect gate
//! ([`KeyCtx::gate`]) first: once the key is killed or its node has fenced,
//! the import has no effect and traps the guest (contract §2, "every host
//! import that causes a side effect checks the fence first"). Expected
//! failures — a full mailbox, an unknown module, a limit — are WIT `result`s
//! the guest can handle; traps are reserved for refusals and kills.
//!
//! Every import charges its host time to the calling callback's CPU budget
//! ([`KeyCtx::charge_host`]): the measured time of its work (one
//! `Instant::now` pair; an async import's waiting for another key or the
//! cache's owner is not counted, that is bounded by its timeout) and an
//! estimate for copying its arguments out of the guest's memory. A guest
//! cannot make the host work for it beyond `cpu_limit`.
//!
//! A tenant's key lives inside its tenant ([`crate::auth`]): the modules
//! it calls and casts to, its topics and its cache namespaces are resolved
//! as `tenant/name`, so it can neither reach nor overhear another tenant.

use std::time::{Duration, Instant};

use crate::auth::{guest_module, guest_scoped};
use crate::bindings::host::Host;
use crate::bindings::types::{self, CacheError, CallError, EffectError, LogLevel};
use crate::cache::unexpected_outcome;
use crate::error::Error;
use crate::host_bytes::SUBSCRIPTION_OVERHEAD;
use crate::key::{KeyCtx, KeyNode, KeyServices, Output, arm_timer, reserve_timer};
use crate::pubsub::MAX_TOPIC_BYTES;
use crate::wire::{CacheOp, CacheOutcome, Expect};

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

    /// Run a synchronous import, charging its host time and its `lifted`
    /// bytes of arguments to the callback's CPU budget.
    pub(crate) fn charged<T>(
        &mut self,
        lifted: usize,
        import: impl FnOnce(&mut Self) -> wasmtime::Result<T>,
    ) -> wasmtime::Result<T> {
        let start = Instant::now();
        let result = import(self);
        self.charge_host(start.elapsed(), lifted)?;
        result
    }
}

impl Host for KeyCtx {
    fn self_key(&mut self) -> wasmtime::Result<String> {
        self.charged(0, |ctx| Ok(ctx.env.key.to_string()))
    }

    fn self_module(&mut self) -> wasmtime::Result<String> {
        self.charged(0, |ctx| Ok(ctx.env.module.to_string()))
    }

    fn ownership_token(&mut self) -> wasmtime::Result<u64> {
        self.charged(0, |ctx| Ok(ctx.env.token.0))
    }

    fn send_after(
        &mut self,
        delay_ms: u64,
        tag: Vec<u8>,
    ) -> wasmtime::Result<Result<u64, EffectError>> {
        self.charged(tag.len(), |ctx| ctx.send_after_now(delay_ms, tag))
    }

    fn cancel_timer(&mut self, id: u64) -> wasmtime::Result<bool> {
        self.charged(0, |ctx| {
            Ok(match ctx.timers.remove(&id) {
                Some(timer) => {
                    timer.abort();
                    true
                }
                // Held by the output gate, not armed yet.
                None => ctx.storage.cancel_timer(id),
            })
        })
    }

    fn subscribe(&mut self, topic: String) -> wasmtime::Result<Result<(), EffectError>> {
        self.charged(topic.len(), |ctx| ctx.subscribe_now(topic))
    }

    fn unsubscribe(&mut self, topic: String) -> wasmtime::Result<()> {
        self.charged(topic.len(), |ctx| ctx.unsubscribe_now(&topic))
    }

    fn publish(
        &mut self,
        topic: String,
        payload: Vec<u8>,
    ) -> wasmtime::Result<Result<u32, EffectError>> {
        self.charged(topic.len() + payload.len(), |ctx| {
            ctx.publish_now(&topic, &payload)
        })
    }

    async fn call(
        &mut self,
        module: String,
        key: String,
        message: Vec<u8>,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<Vec<u8>, CallError>> {
        let start = Instant::now();
        let lifted = module.len() + key.len() + message.len();
        let (_, node) = self.gate_node()?;
        // The callee may act on this call: the writes before it land first.
        self.flush_storage().await?;
        let module = match guest_module(&self.env.module, &module) {
            Ok(module) => module,
            Err(e) => {
                self.charge_host(start.elapsed(), lifted)?;
                return Ok(Err(call_error(e)));
            }
        };
        if module == *self.env.module && key == *self.env.key {
            self.charge_host(start.elapsed(), lifted)?;
            return Ok(Err(CallError::Deadlock));
        }
        self.charge_host(start.elapsed(), lifted)?;
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        // The callee's trace is this callback's (`crate::trace`).
        let call = node.call_key(module, key, message, timeout);
        let result = crate::trace::scope(self.trace, call).await;
        let resumed = Instant::now();
        // The world may have changed while this key waited.
        self.gate()?;
        let result = result.map_err(call_error);
        self.charge_host(resumed.elapsed(), 0)?;
        Ok(result)
    }

    fn cast(
        &mut self,
        module: String,
        key: String,
        message: Vec<u8>,
    ) -> wasmtime::Result<Result<(), EffectError>> {
        let lifted = module.len() + key.len() + message.len();
        self.charged(lifted, |ctx| ctx.cast_now(&module, &key, message))
    }

    async fn cache_get(
        &mut self,
        namespace: String,
        key: String,
    ) -> wasmtime::Result<Result<Option<types::CacheEntry>, CacheError>> {
        let start = Instant::now();
        let lifted = namespace.len() + key.len();
        let (_, node) = self.gate_node()?;
        let namespace = match guest_cache_namespace(&self.env.module, &namespace) {
            Ok(namespace) => namespace,
            Err(e) => {
                self.charge_host(start.elapsed(), lifted)?;
                return Ok(Err(cache_error(e)));
            }
        };
        let op = CacheOp::Get { namespace, key };
        self.charge_host(start.elapsed(), lifted)?;
        let outcome = node.cache(op).await;
        let resumed = Instant::now();
        self.gate()?;
        let result = outcome
            .and_then(|o| match o {
                CacheOutcome::Found(entry) => Ok(entry.map(|e| types::CacheEntry {
                    value: e.value,
                    version: e.version,
                })),
                other => Err(unexpected_outcome(&other)),
            })
            .map_err(cache_error);
        self.charge_host(resumed.elapsed(), 0)?;
        Ok(result)
    }

    async fn cache_put(
        &mut self,
        namespace: String,
        key: String,
        value: Vec<u8>,
        ttl_ms: Option<u64>,
        expected_version: Option<u64>,
    ) -> wasmtime::Result<Result<u64, CacheError>> {
        let start = Instant::now();
        let lifted = namespace.len() + key.len() + value.len();
        let (services, node) = self.gate_node()?;
        self.flush_storage().await?;
        if let Err(e) = services.check_message(&value) {
            self.charge_host(start.elapsed(), lifted)?;
            return Ok(Err(cache_error(e)));
        }
        let namespace = match guest_cache_namespace(&self.env.module, &namespace) {
            Ok(namespace) => namespace,
            Err(e) => {
                self.charge_host(start.elapsed(), lifted)?;
                return Ok(Err(cache_error(e)));
            }
        };
        let op = CacheOp::Put {
            namespace,
            key,
            value,
            ttl_ms: ttl_ms.map(|ms| ms.max(1)),
            expect: expectation(expected_version),
        };
        self.charge_host(start.elapsed(), lifted)?;
        let outcome = node.cache(op).await;
        let resumed = Instant::now();
        self.gate()?;
        let result = outcome
            .and_then(|o| match o {
                CacheOutcome::Written { version } => Ok(version),
                CacheOutcome::Conflict { current } => Err(Error::VersionConflict { current }),
                other => Err(unexpected_outcome(&other)),
            })
            .map_err(cache_error);
        self.charge_host(resumed.elapsed(), 0)?;
        Ok(result)
    }

    async fn cache_delete(
        &mut self,
        namespace: String,
        key: String,
        expected_version: Option<u64>,
    ) -> wasmtime::Result<Result<bool, CacheError>> {
        let start = Instant::now();
        let lifted = namespace.len() + key.len();
        let (_, node) = self.gate_node()?;
        self.flush_storage().await?;
        let namespace = match guest_cache_namespace(&self.env.module, &namespace) {
            Ok(namespace) => namespace,
            Err(e) => {
                self.charge_host(start.elapsed(), lifted)?;
                return Ok(Err(cache_error(e)));
            }
        };
        let op = CacheOp::Delete {
            namespace,
            key,
            expect: expectation(expected_version),
        };
        self.charge_host(start.elapsed(), lifted)?;
        let outcome = node.cache(op).await;
        let resumed = Instant::now();
        self.gate()?;
        let result = outcome
            .and_then(|o| match o {
                CacheOutcome::Deleted(existed) => Ok(existed),
                CacheOutcome::Conflict { current } => Err(Error::VersionConflict { current }),
                other => Err(unexpected_outcome(&other)),
            })
            .map_err(cache_error);
        self.charge_host(resumed.elapsed(), 0)?;
        Ok(result)
    }

    /// A guest's log line: cut at `MAX_LOG_LINE` and held to the key's log
    /// rate ([`crate::guest_log`]); the host time, the copy of the message
    /// included, is the callback's.
    fn log(&mut self, level: LogLevel, message: String) -> wasmtime::Result<()> {
        self.charged(message.len(), |ctx| {
            ctx.gate()?;
            ctx.log.log(level, &message);
            // The message is freed here, inside the charged time.
            drop(message);
            Ok(())
        })
    }
}

/// The imports' work, run inside [`KeyCtx::charged`].
impl KeyCtx {
    fn send_after_now(
        &mut self,
        delay_ms: u64,
        tag: Vec<u8>,
    ) -> wasmtime::Result<Result<u64, EffectError>> {
        let services = self.gate()?;
        if self.timers.len() >= self.env.max_timers as usize {
            return Ok(Err(EffectError::Limit(format!(
                "this key already has {} timers armed (max_timers_per_key)",
                self.timers.len()
            ))));
        }
        let limit = services.config.max_message_size.as_u64() as usize;
        if tag.len() > limit {
            return Ok(Err(EffectError::Invalid(format!(
                "a timer tag is at most {limit} bytes (max_message_size)"
            ))));
        }
        let delay = Duration::from_millis(delay_ms);
        if self.storage.holding() {
            // Armed once the callback's writes are committed.
            return Ok(reserve_timer(self, &tag)
                .map(|(id, held)| {
                    let timer = Output::Timer {
                        id,
                        delay,
                        tag,
                        held,
                    };
                    // The tag is charged in `held`.
                    self.storage.hold(timer, 0).map(|()| id)
                })
                .and_then(|held| held)
                .map_err(|refusal| EffectError::Limit(refusal.to_string())));
        }
        Ok(arm_timer(self, delay, tag).map_err(|refusal| EffectError::Limit(refusal.to_string())))
    }

    fn subscribe_now(&mut self, topic: String) -> wasmtime::Result<Result<(), EffectError>> {
        let services = self.gate()?;
        if let Err(e) = Self::check_topic(&topic) {
            return Ok(Err(e));
        }
        let topic = guest_scoped(&self.env.module, &topic);
        if self.subscriptions.contains_key(&topic) {
            return Ok(Ok(()));
        }
        if self.subscriptions.len() >= self.env.max_subscriptions as usize {
            return Ok(Err(EffectError::Limit(format!(
                "this key already has {} subscriptions (max_subscriptions_per_key)",
                self.subscriptions.len()
            ))));
        }
        // The topic is held twice (here and in the node's topic table).
        let held = match self
            .env
            .mailbox
            .ledger()
            .hold(SUBSCRIPTION_OVERHEAD + 2 * topic.len())
        {
            Ok(held) => held,
            Err(refusal) => return Ok(Err(EffectError::Limit(refusal.to_string()))),
        };
        services.pubsub.subscribe(
            &topic,
            &self.env.module,
            &self.env.key,
            self.env.generation,
            self.env.mailbox.clone(),
        );
        self.subscriptions.insert(topic, held);
        Ok(Ok(()))
    }

    fn unsubscribe_now(&mut self, topic: &str) -> wasmtime::Result<()> {
        let topic = guest_scoped(&self.env.module, topic);
        if self.subscriptions.remove(&topic).is_some()
            && let Some(services) = self.env.services.upgrade()
        {
            services.pubsub.unsubscribe(
                &topic,
                &self.env.module,
                &self.env.key,
                self.env.generation,
            );
        }
        Ok(())
    }

    fn publish_now(
        &mut self,
        topic: &str,
        payload: &[u8],
    ) -> wasmtime::Result<Result<u32, EffectError>> {
        let services = self.gate()?;
        if let Err(e) = Self::check_topic(topic) {
            return Ok(Err(e));
        }
        let topic = guest_scoped(&self.env.module, topic);
        let limit = services.config.max_message_size.as_u64() as usize;
        if payload.len() > limit {
            return Ok(Err(EffectError::Invalid(format!(
                "a payload of {} bytes is over max_message_size ({limit} bytes)",
                payload.len()
            ))));
        }
        if let Err(why) = self.publishes.take(services.clock.now()) {
            return Ok(Err(EffectError::Limit(why)));
        }
        if self.storage.holding() {
            // Delivered once the callback's writes are committed, to the
            // subscribers there are then; it answers how many there are now.
            let subscribers = services.pubsub.subscribers(&topic);
            let bytes = topic.len() + payload.len();
            let publication = Output::Publish {
                topic,
                payload: payload.to_vec(),
            };
            return Ok(self
                .storage
                .hold(publication, bytes)
                .map(|()| subscribers)
                .map_err(|refusal| EffectError::Limit(refusal.to_string())));
        }
        let published = services
            .pubsub
            .publish(&topic, payload, self.env.mailbox.ledger());
        services
            .metrics
            .topics()
            .published(published.forwarded, published.dropped);
        Ok(Ok(published.count))
    }

    fn cast_now(
        &mut self,
        module: &str,
        key: &str,
        message: Vec<u8>,
    ) -> wasmtime::Result<Result<(), EffectError>> {
        let (services, node) = self.gate_node()?;
        let module = guest_module(&self.env.module, module);
        if self.storage.holding() {
            return Ok(self.hold_cast((&services, &*node), module, key, message));
        }
        Ok(module
            .and_then(|module| {
                crate::trace::sync_scope(self.trace, || node.cast_key(&module, key, message))
            })
            .map_err(|e| match e {
                Error::UnknownModule(m) => EffectError::UnknownModule(m),
                Error::Overloaded { .. } | Error::TooManyKeys { .. } | Error::PoolFull { .. } => {
                    EffectError::Overloaded
                }
                other => EffectError::Invalid(other.to_string()),
            }))
    }
}

impl KeyCtx {
    /// A cast after an uncommitted write: checked now (the module, the
    /// size), sent once the writes are committed.
    fn hold_cast(
        &mut self,
        (services, node): (&KeyServices, &dyn KeyNode),
        module: Result<String, Error>,
        key: &str,
        message: Vec<u8>,
    ) -> Result<(), EffectError> {
        let module = module.map_err(|e| EffectError::Invalid(e.to_string()))?;
        if !node.has_module(&module) {
            return Err(EffectError::UnknownModule(module));
        }
        services
            .check_message(&message)
            .map_err(|e| EffectError::Invalid(e.to_string()))?;
        let bytes = module.len() + key.len() + message.len();
        let cast = Output::Cast {
            module,
            key: key.to_owned(),
            message,
            trace: self.trace,
        };
        self.storage
            .hold(cast, bytes)
            .map_err(|refusal| EffectError::Limit(refusal.to_string()))
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
