//! Cluster-wide deploys: every node follows the arbiter's module store.
//!
//! A deploy on any node is validated and compiled there first (nothing is
//! stored if it fails), then stored in the arbiter as the module's next
//! version, which becomes current; the node that took the deploy installs it
//! before answering. Every node runs a *module follower*: on every renewal
//! interval (and at once when a peer nudges it after a change) it reads the
//! store's listing and makes its installed modules match: it loads each
//! current version it does not have (bytes from the store, compiled code
//! from the [compile cache](crate::compile_cache) when there), and unloads
//! the modules that are gone, stopping their keys (`terminate(undeployed)`,
//! then a kill for what does not stop in time). A node loads the whole store
//! before it joins its cluster, so a restarted node never owns a partition
//! without its modules.
//!
//! Versions: new activations use the current version; a live key keeps the
//! version it was activated with until its process ends (idle timeout, a
//! move, a kill), and its next activation uses the current one. A rollback
//! makes an older stored version current again, with the same rule.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::Notify;

use super::{Instance, ModuleInfo, NodeShared, module_info};
use crate::arbiter::{ANONYMOUS, ModuleVersionRecord, NewModuleVersion};
use crate::bindings::types::StopReason;
use crate::compile_worker::CompileWorker;
use crate::config::{ModuleOptions, validate_module_name};
use crate::error::{Error, Result};
use crate::key::ModuleSlot;
use crate::module::{self, Code, CompiledModule};
use crate::sync::lock;
use crate::wire::{LoadedModules, PeerRequest};

/// How long one module store operation may take (a listing, or moving a
/// large component's bytes).
const STORE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the keys of an undeployed module get to stop gracefully before
/// they are killed.
const UNDEPLOY_GRACE: Duration = Duration::from_secs(2);

/// How long a node waits for each peer's answer when it lists which versions
/// the cluster's nodes have loaded.
const PEER_QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// A node's deploy bookkeeping.
#[derive(Default)]
pub(crate) struct Deploys {
    /// Serializes this node's changes to its installed modules (the
    /// follower's rounds, deploys, rollbacks, undeploys).
    install: tokio::sync::Mutex<()>,
    /// Wakes the follower for a round now.
    wake: Notify,
    /// Current versions this node could not load, as (version, content
    /// hash) with the error: not retried until the store's current version
    /// of that module changes.
    failed: std::sync::Mutex<HashMap<String, (u64, String)>>,
    /// Modules given to the builder that could not be stored because the
    /// arbiter was unreachable at start: installed here, stored by the
    /// follower as soon as it can, and never unloaded meanwhile.
    unstored: std::sync::Mutex<Vec<NewModuleVersion>>,
    /// Compiles running on this node: one at a time (a compile uses every
    /// core already), each holding its permit until its thread ends, even
    /// when the deploy stopped waiting for it.
    compiles: CompileSlots,
    /// Tenants with a compile in flight: one each, so one tenant's deploys
    /// cannot fill the queue ahead of everyone else's.
    compiling_tenants: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The components in use at the follower's last round (content hashes),
    /// so the next can tell which left use.
    cache_in_use: std::sync::Mutex<Option<HashSet<String>>>,
}

/// The node's compile permits.
struct CompileSlots(Arc<tokio::sync::Semaphore>);

impl Default for CompileSlots {
    fn default() -> Self {
        CompileSlots(Arc::new(tokio::sync::Semaphore::new(1)))
    }
}

/// Releases a tenant's compile slot when its deploy ends.
struct TenantCompile<'a> {
    deploys: &'a Deploys,
    tenant: String,
}

impl Drop for TenantCompile<'_> {
    fn drop(&mut self) {
        lock(&self.deploys.compiling_tenants).remove(&self.tenant);
    }
}

impl Deploys {
    /// Ask the follower for a round now (a peer changed the store).
    pub(crate) fn wake(&self) {
        self.wake.notify_one();
    }
}

/// One module of the cluster, as `GET /v1/modules` and `fief modules` show
/// it: the store's versions and which version each node has loaded.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ModuleListing {
    /// The module name.
    pub name: String,
    /// The version new activations use.
    pub current: u64,
    /// Every stored version, oldest first.
    pub versions: Vec<ModuleVersionRecord>,
    /// The version each node has loaded (node id → version), for this node
    /// and every live peer that answered.
    pub loaded_on: BTreeMap<String, u64>,
    /// Live nodes of the namespace, as this node last heard from the
    /// arbiter (at least 1: this node).
    pub nodes: usize,
    /// Live keys of the module on this node.
    pub live_keys: usize,
}

/// Check a module name as the store keeps it: a plain name, or a tenant's
/// `tenant/name` (the API layer qualifies a tenant's names), each part a
/// plain name.
fn validate_stored_name(name: &str) -> Result<()> {
    match name.split_once('/') {
        None => validate_module_name(name),
        Some((tenant, local)) => validate_module_name(tenant)
            .and_then(|()| validate_module_name(local))
            .map_err(|_| Error::InvalidModuleName {
                name: name.to_owned(),
                why: "a tenant's module is `tenant/name`, each part a plain module name".to_owned(),
            }),
    }
}

/// Run `f` on a blocking thread.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("a compile task failed: {e}")))?
}

async fn bounded<T>(f: crate::arbiter::ArbiterFuture<'_, T>) -> Result<T> {
    tokio::time::timeout(STORE_TIMEOUT, f)
        .await
        .map_err(|_| {
            Error::ModuleStore(format!(
                "the arbiter did not answer within {STORE_TIMEOUT:?}"
            ))
        })?
        .map_err(Error::from)
}

impl NodeShared {
    /// Validate and compile `wasm`, store it as the next version of `name`
    /// (see [`Instance::deploy_as`]), install it here and tell the peers.
    pub(crate) async fn deploy_module(
        self: &Arc<Self>,
        name: &str,
        wasm: Bytes,
        options: ModuleOptions,
        deployed_by: &str,
    ) -> Result<ModuleInfo> {
        validate_stored_name(name)?;
        options.validate_for(&self.config, &self.config.lease_timing()?)?;
        let _tenant_slot = match name.split_once('/') {
            Some((tenant, _)) => {
                if !lock(&self.deploys.compiling_tenants).insert(tenant.to_owned()) {
                    return Err(Error::CompileBusy {
                        tenant: tenant.to_owned(),
                    });
                }
                Some(TenantCompile {
                    deploys: &self.deploys,
                    tenant: tenant.to_owned(),
                })
            }
            None => None,
        };
        let mut compiled = self
            .compile_off_thread(wasm.clone(), options.clone(), 0)
            .await?;
        let guard = self.deploys.install.lock().await;
        let record = bounded(self.arbiter.put_module(
            &self.config.namespace,
            NewModuleVersion {
                name: name.to_owned(),
                bytes: wasm,
                content_hash: compiled.content_hash.clone(),
                options,
                deployed_by: deployed_by.to_owned(),
            },
        ))
        .await?;
        compiled.version = record.version;
        compiled.deployed_at = record.deployed_at;
        tracing::info!(
            module = name,
            version = record.version,
            bytes = compiled.size_bytes,
            compile_ms = compiled.compile_time.as_millis(),
            cached = compiled.compile_cached,
            deployed_by,
            "module deployed"
        );
        lock(&self.deploys.failed).remove(name);
        let info = self.install(name, compiled);
        drop(guard);
        self.nudge_peers().await;
        Ok(info)
    }

    /// Deploy a module given to the builder: as [`NodeShared::deploy_module`],
    /// except that an unreachable arbiter does not fail the start: the
    /// module is installed here (as version 0) and stored by the follower
    /// once the arbiter answers.
    pub(crate) async fn deploy_at_start(
        self: &Arc<Self>,
        name: &str,
        wasm: Bytes,
        options: ModuleOptions,
    ) -> Result<()> {
        match self
            .deploy_module(name, wasm.clone(), options.clone(), ANONYMOUS)
            .await
        {
            Err(Error::ModuleStore(why)) => {
                tracing::warn!(node = %self.node_id, module = name, error = %why, "cannot store a module at start; serving it here and storing it when the arbiter answers");
                let compiled = self
                    .compile_off_thread(wasm.clone(), options.clone(), 0)
                    .await?;
                lock(&self.deploys.unstored).push(NewModuleVersion {
                    name: name.to_owned(),
                    bytes: wasm,
                    content_hash: compiled.content_hash.clone(),
                    options,
                    deployed_by: ANONYMOUS.to_owned(),
                });
                self.install(name, compiled);
                Ok(())
            }
            other => other.map(|_| ()),
        }
    }

    /// Validate and compile, holding the node's compile slot: in the
    /// node's compile worker when it has one (killed at `compile_timeout`,
    /// its memory capped), else on a blocking thread.
    async fn compile_off_thread(
        self: &Arc<Self>,
        wasm: Bytes,
        options: ModuleOptions,
        version: u64,
    ) -> Result<CompiledModule> {
        let permit = self
            .deploys
            .compiles
            .0
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Error::ShuttingDown)?;
        let compiled = match CompileWorker::for_node(&self.config) {
            Some(worker) => {
                let compiled = self
                    .compile_in_worker(&worker, wasm, options, version)
                    .await;
                // A worker that timed out or ran out of memory is dead
                // already (killed when its future was dropped): its slot is
                // free at once.
                drop(permit);
                compiled?
            }
            None => {
                self.compile_in_process(permit, wasm, options, version)
                    .await?
            }
        };
        self.metrics
            .compiled(compiled.compile_cached, compiled.compile_time);
        Ok(compiled)
    }

    /// Compile in `worker`: the static checks and the compile cache here,
    /// the compile in the worker process, loading its artifact here.
    async fn compile_in_worker(
        self: &Arc<Self>,
        worker: &CompileWorker,
        wasm: Bytes,
        options: ModuleOptions,
        version: u64,
    ) -> Result<CompiledModule> {
        let (shared, bytes, opts) = (self.clone(), wasm.clone(), options.clone());
        let mut checked = blocking(move || module::check(&shared.runtime, &bytes, &opts)).await?;
        let started = std::time::Instant::now();
        let code = match checked.cached.take() {
            Some(component) => Code::Cached(component),
            None => Code::Artifact(worker.precompile(&wasm).await?),
        };
        let compile_time = started.elapsed();
        let shared = self.clone();
        blocking(move || {
            module::finish(
                &shared.runtime,
                checked,
                code,
                wasm.len(),
                options,
                version,
                compile_time,
            )
        })
        .await
    }

    /// Compile on a blocking thread, which keeps `permit` until it ends: a
    /// compile past `compile_timeout` is refused, but cannot be stopped.
    async fn compile_in_process(
        self: &Arc<Self>,
        permit: tokio::sync::OwnedSemaphorePermit,
        wasm: Bytes,
        options: ModuleOptions,
        version: u64,
    ) -> Result<CompiledModule> {
        let shared = self.clone();
        let compiling = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            module::compile(&shared.runtime, &wasm, options, version)
        });
        let limit = self.config.compile_timeout;
        tokio::time::timeout(limit, compiling)
            .await
            .map_err(|_| {
                Error::InvalidModule(format!(
                    "compiling the component took longer than this node's compile_timeout \
                     ({limit:?}); it is refused (the compile finishes in the background \
                     holding the node's compile slot: give the node a compile_worker to \
                     have it stopped). Build it smaller"
                ))
            })?
            .map_err(|e| Error::Internal(format!("the compile task failed: {e}")))?
    }

    /// Make `compiled` the version of `name` new activations use here.
    fn install(&self, name: &str, compiled: CompiledModule) -> ModuleInfo {
        // Installed here is seen in use, whether or not a follower round
        // runs before it is replaced: the next round's trim then knows to
        // remove its entry once nothing uses it (the trim test failed when
        // no round ran between a deploy and the redeploy that replaced it).
        if let Some(seen) = lock(&self.deploys.cache_in_use).as_mut() {
            seen.insert(compiled.content_hash.clone());
        }
        let existing = self.module(name).ok();
        let slot = match existing {
            Some(slot) => {
                slot.replace(compiled);
                slot
            }
            None => {
                let slot = Arc::new(ModuleSlot::new(
                    name,
                    compiled,
                    self.metrics.inline_calls(name),
                ));
                self.modules.rcu(|modules| {
                    let mut modules = HashMap::clone(modules);
                    modules.insert(name.to_owned(), slot.clone());
                    modules
                });
                slot
            }
        };
        module_info(&slot)
    }

    /// One round of the module follower: make the installed modules match
    /// the store. Errors loading one module are logged and remembered; an
    /// error reading the store is returned.
    pub(crate) async fn sync_modules(self: &Arc<Self>) -> Result<()> {
        let ns = &self.config.namespace;
        let unstored = std::mem::take(&mut *lock(&self.deploys.unstored));
        for (i, module) in unstored.iter().enumerate() {
            if let Err(e) = bounded(self.arbiter.put_module(ns, module.clone())).await {
                lock(&self.deploys.unstored).extend(unstored[i..].iter().cloned());
                return Err(e);
            }
        }
        let stored = bounded(self.arbiter.modules(ns)).await?;
        let _guard = self.deploys.install.lock().await;
        for module in &stored {
            let Some(record) = module.current_record() else {
                continue;
            };
            let installed = self.module(&module.name).ok().map(|slot| slot.current());
            if installed.is_some_and(|c| {
                c.version == record.version && c.content_hash == record.content_hash
            }) {
                continue;
            }
            let wanted = (record.version, record.content_hash.clone());
            if lock(&self.deploys.failed)
                .get(&module.name)
                .is_some_and(|failed| *failed == wanted)
            {
                continue;
            }
            match self.load(&module.name, record).await {
                Ok(info) => {
                    lock(&self.deploys.failed).remove(&module.name);
                    tracing::info!(
                        node = %self.node_id,
                        module = %module.name,
                        version = info.version,
                        compile_ms = info.compile_ms,
                        cached = info.compile_cached,
                        "module loaded from the store"
                    );
                }
                Err(e) => {
                    tracing::warn!(
                        node = %self.node_id,
                        module = %module.name,
                        version = record.version,
                        error = %e,
                        "cannot load a stored module version; keeping what is installed"
                    );
                    lock(&self.deploys.failed).insert(module.name.clone(), wanted);
                }
            }
        }
        let names: HashSet<&str> = stored.iter().map(|m| m.name.as_str()).collect();
        let gone: Vec<Arc<ModuleSlot>> = self
            .slots()
            .into_iter()
            .filter(|slot| !names.contains(&*slot.name))
            .collect();
        for slot in gone {
            self.unload(&slot).await;
        }
        self.trim_compile_cache(&stored);
        Ok(())
    }

    /// Remove the compile cache's entries of the components that left use
    /// since the last round: in use are the store's current versions, what
    /// is installed here, and what waits to be stored. So an undeploy, a
    /// redeploy or a rollback removes what its change left unused; entries
    /// this node never saw in use (another node's sharing the directory, or
    /// a previous run's) are left alone, and so is everything at the first
    /// round, when nothing has changed yet. A rollback to a version whose
    /// entry went compiles it again; a live key on an older version keeps
    /// running (its code is mapped, and an unlinked file's mapping stays
    /// valid). Runs under the install lock.
    fn trim_compile_cache(&self, stored: &[crate::arbiter::StoredModule]) {
        let Some(cache) = self.runtime.compile_cache.as_ref() else {
            return;
        };
        let mut in_use: HashSet<String> = stored
            .iter()
            .filter_map(|m| m.current_record())
            .map(|record| record.content_hash.clone())
            .collect();
        in_use.extend(
            self.slots()
                .iter()
                .map(|slot| slot.current().content_hash.clone()),
        );
        in_use.extend(
            lock(&self.deploys.unstored)
                .iter()
                .map(|m| m.content_hash.clone()),
        );
        let mut last = lock(&self.deploys.cache_in_use);
        if let Some(last) = last.as_ref() {
            let removed = cache.remove(last.difference(&in_use).map(String::as_str));
            if removed > 0 {
                tracing::info!(node = %self.node_id, removed, "compile cache trimmed to the versions in use");
            }
        }
        *last = Some(in_use);
    }

    /// Load one stored version: its bytes from the store, compiled (or taken
    /// from the compile cache), checked against its content hash.
    async fn load(
        self: &Arc<Self>,
        name: &str,
        record: &ModuleVersionRecord,
    ) -> Result<ModuleInfo> {
        let ns = &self.config.namespace;
        let bytes = bounded(self.arbiter.module_bytes(ns, name, record.version))
            .await?
            .ok_or_else(|| {
                Error::ModuleStore(format!(
                    "version {} of module {name:?} has no bytes in the store",
                    record.version
                ))
            })?;
        let (options, lowered) =
            crate::load_ceilings::lower_to_ceilings(&self.config, &record.options);
        for l in &lowered {
            tracing::warn!(
                node = %self.node_id,
                module = name,
                version = record.version,
                option = l.option,
                value = %l.value,
                ceiling = %l.ceiling,
                "a stored module version asks for more than this node's ceiling: running it \
                 with the option lowered to the ceiling"
            );
            self.metrics.module_option_lowered(l.option);
        }
        let mut compiled = self
            .compile_off_thread(bytes, options, record.version)
            .await?;
        if compiled.content_hash != record.content_hash {
            return Err(Error::ModuleStore(format!(
                "version {} of module {name:?} has content hash {} in the store, but its bytes hash to {}",
                record.version, record.content_hash, compiled.content_hash
            )));
        }
        compiled.deployed_at = record.deployed_at;
        Ok(self.install(name, compiled))
    }

    /// Unload a module that left the store: no new activations from now on;
    /// its keys stop (`terminate(undeployed)`), and what has not stopped
    /// within [`UNDEPLOY_GRACE`] is killed.
    async fn unload(&self, slot: &Arc<ModuleSlot>) {
        self.modules.rcu(|modules| {
            let mut modules = HashMap::clone(modules);
            modules.remove(&*slot.name);
            modules
        });
        let stops: Vec<_> = slot
            .live_key_names()
            .iter()
            .filter_map(|key| slot.stop(key, StopReason::Undeployed))
            .collect();
        let keys = stops.len();
        let graceful = async {
            for rx in stops {
                let _ = rx.await;
            }
        };
        let _ = tokio::time::timeout(UNDEPLOY_GRACE, graceful).await;
        // Also catches a key activated by a message routed just before the
        // module left the table.
        let killed = slot.kill_where("the module was undeployed", |_| true);
        if killed > 0 {
            self.runtime.engine.increment_epoch();
        }
        lock(&self.deploys.failed).remove(&*slot.name);
        tracing::info!(node = %self.node_id, module = %slot.name, keys, killed, "module undeployed");
    }

    /// Tell every live peer to run its module follower now.
    async fn nudge_peers(&self) {
        let addrs = self.peer_addrs();
        let requests = addrs.iter().map(|addr| {
            self.peers
                .request(addr, PeerRequest::Nudge, PEER_QUERY_TIMEOUT)
        });
        for (addr, outcome) in addrs
            .iter()
            .zip(futures_util::future::join_all(requests).await)
        {
            if let Err(e) = outcome {
                tracing::debug!(peer = %addr, error = %e, "nudging a peer after a module change failed");
            }
        }
    }

    /// The peer addresses of the other live nodes.
    fn peer_addrs(&self) -> Vec<String> {
        self.members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .filter(|m| m.node != self.node_id)
            .filter_map(|m| m.peer_addr.clone())
            .collect()
    }

    /// The versions installed here, encoded for a peer.
    pub(crate) fn loaded_modules(&self) -> Vec<u8> {
        let loaded = LoadedModules(
            self.slots()
                .iter()
                .map(|slot| (slot.name.to_string(), slot.current().version))
                .collect(),
        );
        postcard::to_allocvec(&loaded).unwrap_or_default()
    }

    /// The versions every live node has loaded: node id → module → version.
    async fn loaded_everywhere(&self) -> BTreeMap<String, HashMap<String, u64>> {
        let mut everywhere = BTreeMap::new();
        let mine = self
            .slots()
            .iter()
            .map(|slot| (slot.name.to_string(), slot.current().version))
            .collect();
        everywhere.insert(self.node_id.to_string(), mine);
        let peers: Vec<(String, String)> = self
            .members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .filter(|m| m.node != self.node_id)
            .filter_map(|m| Some((m.node.to_string(), m.peer_addr.clone()?)))
            .collect();
        let requests = peers.iter().map(|(_, addr)| {
            self.peers
                .request(addr, PeerRequest::LoadedModules, PEER_QUERY_TIMEOUT)
        });
        for ((node, _), answer) in peers
            .iter()
            .zip(futures_util::future::join_all(requests).await)
        {
            match answer.map(|bytes| postcard::from_bytes::<LoadedModules>(&bytes)) {
                Ok(Ok(LoadedModules(loaded))) => {
                    everywhere.insert(node.clone(), loaded.into_iter().collect());
                }
                Ok(Err(e)) => {
                    tracing::debug!(%node, error = %e, "a peer's module list does not decode")
                }
                Err(e) => tracing::debug!(%node, error = %e, "a peer did not list its modules"),
            }
        }
        everywhere
    }
}

impl Instance {
    /// Deploy a module to the cluster as `deployed_by` (a tenant or admin
    /// identity; [`Instance::deploy`] uses `"anonymous"`).
    ///
    /// The component is validated and compiled on this node first; nothing
    /// is stored if that fails. It is then stored in the arbiter as the
    /// module's next version (numbered from 1 per name) and becomes current;
    /// this node installs it before returning, and every other node loads it
    /// within a renewal interval (at once if it hears this node's nudge).
    /// New activations use the new version; live keys finish on theirs.
    /// Deploying the current version's bytes and options again stores
    /// nothing and returns that version.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidModuleName`], [`Error::InvalidOptions`] or
    /// [`Error::InvalidModule`] saying what is wrong (nothing is stored), or
    /// [`Error::ModuleStore`] if the arbiter cannot store it.
    pub async fn deploy_as(
        &self,
        name: &str,
        wasm: impl Into<Bytes>,
        options: ModuleOptions,
        deployed_by: &str,
    ) -> Result<ModuleInfo> {
        self.shared
            .deploy_module(name, wasm.into(), options, deployed_by)
            .await
    }

    /// The cluster's modules: the store's versions of each, which one is
    /// current, and which version each live node has loaded.
    ///
    /// # Errors
    ///
    /// [`Error::ModuleStore`] if the arbiter cannot be read.
    pub async fn modules(&self) -> Result<Vec<ModuleListing>> {
        let shared = &self.shared;
        let stored = bounded(shared.arbiter.modules(&shared.config.namespace)).await?;
        let everywhere = shared.loaded_everywhere().await;
        let nodes = shared
            .members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
            .max(1);
        Ok(stored
            .into_iter()
            .map(|m| ModuleListing {
                loaded_on: everywhere
                    .iter()
                    .filter_map(|(node, loaded)| Some((node.clone(), *loaded.get(&m.name)?)))
                    .collect(),
                live_keys: shared.module(&m.name).map_or(0, |slot| slot.live_keys()),
                nodes,
                name: m.name,
                current: m.current,
                versions: m.versions,
            })
            .collect())
    }

    /// Make a stored `version` of `module` current again, for the whole
    /// cluster: new activations use it, live keys finish on theirs. This
    /// node loads it before returning; the others follow.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownModule`] or [`Error::UnknownModuleVersion`], or
    /// [`Error::ModuleStore`].
    pub async fn rollback(&self, module: &str, version: u64) -> Result<ModuleInfo> {
        let shared = &self.shared;
        let ns = &shared.config.namespace;
        let stored = bounded(shared.arbiter.modules(ns)).await?;
        let found = stored
            .iter()
            .find(|m| m.name == module)
            .ok_or_else(|| Error::UnknownModule(module.to_owned()))?;
        if !found.versions.iter().any(|v| v.version == version) {
            return Err(Error::UnknownModuleVersion {
                module: module.to_owned(),
                version,
                stored: found
                    .versions
                    .iter()
                    .map(|v| v.version.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        bounded(shared.arbiter.set_current_module(ns, module, version)).await?;
        shared.sync_modules().await?;
        shared.nudge_peers().await;
        let slot = shared.module(module)?;
        if slot.current().version != version {
            return Err(Error::ModuleStore(format!(
                "version {version} of {module:?} is current in the store, but this node could not load it (see its log)"
            )));
        }
        Ok(module_info(&slot))
    }

    /// Undeploy `module` from the whole cluster: remove it and all its
    /// versions from the store, stop its keys here (`terminate(undeployed)`;
    /// killed if they do not stop within two seconds), and have every other
    /// node do the same. Later calls to it fail with `unknown_module`.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownModule`] if it is not deployed, or
    /// [`Error::ModuleStore`].
    pub async fn undeploy(&self, module: &str) -> Result<()> {
        let shared = &self.shared;
        let removed = bounded(
            shared
                .arbiter
                .remove_module(&shared.config.namespace, module),
        )
        .await?;
        shared.sync_modules().await?;
        shared.nudge_peers().await;
        if removed {
            Ok(())
        } else {
            Err(Error::UnknownModule(module.to_owned()))
        }
    }

    /// Run a module follower round now (instead of waiting for the next
    /// renewal interval): load what the store has and this node lacks,
    /// unload what it no longer has.
    ///
    /// # Errors
    ///
    /// [`Error::ModuleStore`] if the arbiter cannot be read.
    pub async fn sync_modules(&self) -> Result<()> {
        self.shared.sync_modules().await
    }
}

/// The module follower: a round every renewal interval, or at once when
/// woken. Runs beside the coordination loop and ends with it.
pub(crate) async fn follow_modules(shared: Arc<NodeShared>) {
    loop {
        if let Err(e) = shared.sync_modules().await {
            tracing::debug!(node = %shared.node_id, error = %e, "module follower: cannot read the store");
        }
        tokio::select! {
            () = tokio::time::sleep(shared.config.renew_interval) => {}
            () = shared.deploys.wake.notified() => {}
        }
    }
}
