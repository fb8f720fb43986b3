//! The module store's records: what the arbiter keeps about each deployed
//! module so that every node of a namespace runs the same versions.
//!
//! A module *name* is an opaque string to the store (the API layer may
//! namespace it per tenant). Each deploy of a name adds a *version*, numbered
//! from 1 and strictly increasing per name for the namespace's lifetime (an
//! undeploy keeps the counter, so a later deploy of the same name never
//! reuses a number). One version per name is *current*: the one new
//! activations use. The component's bytes are kept with each version, so a
//! node that starts later, or a rollback, can load any stored version.

use std::time::SystemTime;

use serde::Serialize;

use crate::config::ModuleOptions;

/// Who deployed a module when nobody authenticated the deploy.
pub const ANONYMOUS: &str = "anonymous";

/// A version to store: the output of a deploy that passed validation.
#[derive(Clone, Debug)]
pub struct NewModuleVersion {
    /// The module name.
    pub name: String,
    /// The component.
    pub bytes: bytes::Bytes,
    /// SHA-256 of `bytes`, lowercase hex.
    pub content_hash: String,
    /// The options its keys run under.
    pub options: ModuleOptions,
    /// The identity that deployed it (a tenant, an admin, or [`ANONYMOUS`]).
    pub deployed_by: String,
}

/// One stored version of a module (without its bytes).
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ModuleVersionRecord {
    /// The version number, from 1, strictly increasing per name.
    pub version: u64,
    /// SHA-256 of the component, lowercase hex.
    pub content_hash: String,
    /// Size of the component, in bytes.
    pub size_bytes: u64,
    /// The options its keys run under.
    pub options: ModuleOptions,
    /// Who deployed it.
    pub deployed_by: String,
    /// When the arbiter stored it (RFC 3339, UTC).
    #[serde(with = "humantime_serde")]
    #[schema(value_type = String)]
    pub deployed_at: SystemTime,
}

/// A deployed module in the store: its versions and which one is current.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StoredModule {
    /// The module name.
    pub name: String,
    /// The version new activations use.
    pub current: u64,
    /// Every stored version, oldest first.
    pub versions: Vec<ModuleVersionRecord>,
}

impl StoredModule {
    /// The record of the current version.
    pub fn current_record(&self) -> Option<&ModuleVersionRecord> {
        self.versions.iter().find(|v| v.version == self.current)
    }
}
