//! Tenants and API tokens: who is calling the HTTP API, and which modules,
//! keys and cache entries they may touch.
//!
//! A node reads its tokens at start ([`Auth::from_file`], `fief node --tokens
//! FILE`, `FIEF_TOKENS_FILE`, `FIEF_ADMIN_TOKEN`). With **no token
//! configured the API is open** — every caller is [`Identity::Open`] and may
//! do anything, as a single embedded node always could. With tokens, every
//! request carries `Authorization: Bearer TOKEN` and is one of:
//!
//! - [`Identity::Admin`]: cluster operations (`leave`, every module, every
//!   cache namespace, limbo of everyone); it names a tenant's module by its
//!   full name `tenant/module`.
//! - [`Identity::Tenant`]: only its own modules, keys and cache. The module
//!   `counter` of tenant `acme` is stored and routed as `acme/counter`;
//!   `PUT /v1/modules/counter` with an `acme` token deploys `acme/counter`.
//!   Another tenant's module answers `404 unknown_module`, exactly like a
//!   module that does not exist, so names do not leak.
//!
//! Tokens are kept only as SHA-256 digests and compared in constant time
//! ([`subtle::ConstantTimeEq`], every stored digest checked, no early exit);
//! no `Debug` impl here prints a token or a digest. Guests of a tenant's
//! module are scoped the same way: the modules they call, the topics they
//! use and their cache namespaces are resolved inside the tenant
//! ([`guest_module`], [`guest_scoped`]).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::validate_module_name;
use crate::error::{Error, Result};
use crate::sandbox::TenantLimits;

/// Shortest plain token accepted (bytes); shorter ones are guessable.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Who made an API request. The HTTP layer puts it in the request's
/// extensions (`axum::Extension<Identity>`) before any handler runs, so a
/// handler that records who did something (e.g. `deployed_by`) reads it
/// there and stores [`Identity::label`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Identity {
    /// The node has no tokens configured: the API is open to anyone who
    /// can reach it, with every power.
    Open,
    /// An admin token: cluster operations and every tenant's modules.
    Admin,
    /// A tenant's token: only the tenant's own modules, keys and cache.
    Tenant(Arc<str>),
}

impl Identity {
    /// The tenant, if the caller is one.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Identity::Tenant(name) => Some(name),
            Identity::Open | Identity::Admin => None,
        }
    }

    /// A short label for records and logs (a module version's
    /// `deployed_by`): `anonymous` on an open node, `admin`, or
    /// `tenant:NAME`.
    pub fn label(&self) -> String {
        match self {
            Identity::Open => "anonymous".to_owned(),
            Identity::Admin => "admin".to_owned(),
            Identity::Tenant(name) => format!("tenant:{name}"),
        }
    }

    /// The stored name of the module the caller calls `name`.
    ///
    /// A tenant's `counter` is `acme/counter` (a tenant may also write its
    /// own prefix). The admin names any module in full. An open node takes
    /// only plain names, as before tenants existed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidModuleName`] for a malformed name;
    /// [`Error::UnknownModule`] (404, as for a module that does not exist)
    /// when a tenant names another tenant's module.
    pub fn module(&self, name: &str) -> Result<String> {
        match self {
            Identity::Open => {
                validate_module_name(name)?;
                Ok(name.to_owned())
            }
            Identity::Admin => {
                crate::config::validate_qualified_module_name(name)?;
                Ok(name.to_owned())
            }
            Identity::Tenant(tenant) => scoped_module(tenant, name),
        }
    }

    /// The name under which the caller sees the stored module `stored`, or
    /// `None` if it is not the caller's to see.
    pub fn visible_module(&self, stored: &str) -> Option<String> {
        match self {
            Identity::Open | Identity::Admin => Some(stored.to_owned()),
            Identity::Tenant(tenant) => stored
                .strip_prefix(&**tenant)
                .and_then(|rest| rest.strip_prefix('/'))
                .map(str::to_owned),
        }
    }

    /// The stored cache namespace the caller calls `namespace`: a tenant's
    /// `sessions` is `acme/sessions`, the same namespace its guests use.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] for a malformed namespace, or a tenant naming
    /// one outside its own.
    pub fn cache_namespace(&self, namespace: &str) -> Result<String> {
        match self {
            Identity::Admin => Ok(namespace.to_owned()),
            Identity::Open if namespace.contains('/') => Err(Error::InvalidKey(format!(
                "cache namespace {namespace:?} must not contain '/' (that is for tenants' namespaces, on nodes with tokens)"
            ))),
            Identity::Open => Ok(namespace.to_owned()),
            Identity::Tenant(tenant) => {
                if namespace.contains('/') {
                    return Err(Error::InvalidKey(format!(
                        "cache namespace {namespace:?}: a tenant names its own namespaces without a '/' prefix"
                    )));
                }
                Ok(format!("{tenant}/{namespace}"))
            }
        }
    }

    /// Refuse the caller unless it may run cluster operations (`what`).
    ///
    /// # Errors
    ///
    /// [`Error::Forbidden`] for a tenant.
    pub fn require_admin(&self, what: &str) -> Result<()> {
        match self {
            Identity::Open | Identity::Admin => Ok(()),
            Identity::Tenant(tenant) => Err(Error::Forbidden(format!(
                "{what} is a cluster operation: it needs an admin token, and tenant {tenant:?} sent its own"
            ))),
        }
    }
}

/// A tenant's module `name` as stored: `tenant/name`.
fn scoped_module(tenant: &str, name: &str) -> Result<String> {
    match name.split_once('/') {
        None => {
            validate_module_name(name)?;
            Ok(format!("{tenant}/{name}"))
        }
        Some((prefix, local)) if prefix == tenant => {
            validate_module_name(local)?;
            Ok(name.to_owned())
        }
        // Another tenant's module, or no module at all: the same answer.
        Some(_) => Err(Error::UnknownModule(name.to_owned())),
    }
}

/// The tenant owning the stored module name `module` (`acme/counter` →
/// `acme`), if any.
pub fn tenant_of(module: &str) -> Option<&str> {
    module.split_once('/').map(|(tenant, _)| tenant)
}

/// The module a guest of `caller` (a stored module name) reaches when it
/// calls `target`: inside the caller's tenant if it has one, as given
/// otherwise.
///
/// # Errors
///
/// [`Error::UnknownModule`] when a tenant's guest names another tenant's
/// module; [`Error::InvalidModuleName`] for a malformed name.
pub fn guest_module(caller: &str, target: &str) -> Result<String> {
    match tenant_of(caller) {
        Some(tenant) => scoped_module(tenant, target),
        None => Ok(target.to_owned()),
    }
}

/// A topic or cache namespace of a guest of `caller`, inside the caller's
/// tenant if it has one (`acme/name`), as given otherwise.
pub fn guest_scoped(caller: &str, name: &str) -> String {
    match tenant_of(caller) {
        Some(tenant) => format!("{tenant}/{name}"),
        None => name.to_owned(),
    }
}

/// The SHA-256 digest of a token; the only form in which a node keeps one.
#[derive(Clone, Copy)]
struct TokenDigest([u8; 32]);

impl TokenDigest {
    fn of(token: &str) -> Self {
        TokenDigest(Sha256::digest(token.as_bytes()).into())
    }

    fn from_hex(hex: &str) -> Option<Self> {
        let hex = hex.trim();
        if hex.len() != 64 || !hex.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(TokenDigest(out))
    }

    /// Constant-time equality: the time taken does not depend on where the
    /// digests differ.
    fn matches(&self, other: &TokenDigest) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TokenDigest(<redacted>)")
    }
}

/// The lowercase hex SHA-256 of `token`, as written in a tokens file's
/// `token_sha256` lists (`fief token hash`).
pub fn hash_token(token: &str) -> String {
    TokenDigest::of(token)
        .0
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A fresh random token: 32 bytes from the system's secure random source,
/// as 64 hex characters.
///
/// # Errors
///
/// [`Error::Internal`] if the system has no randomness to give.
pub fn new_token() -> Result<String> {
    let mut bytes = [0u8; 32];
    crate::tls::fill_random(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The tokens a node accepts, each as a digest with the identity it grants,
/// and each tenant's caps on its modules' options.
#[derive(Clone, Default)]
pub struct Auth {
    entries: Vec<(TokenDigest, Identity)>,
    limits: BTreeMap<String, Arc<TenantLimits>>,
}

/// The caps that apply to a request's deploys: the tenant's
/// [`TenantLimits`], or `None` for the admin and on an open node (whose
/// deploys are bounded by the node's own limits only). The HTTP layer puts
/// it in the request's extensions beside the [`Identity`].
#[derive(Clone, Debug, Default)]
pub struct DeployCaps(pub Option<Arc<TenantLimits>>);

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tenants: std::collections::BTreeSet<_> = self
            .entries
            .iter()
            .filter_map(|(_, i)| i.tenant())
            .collect();
        f.debug_struct("Auth")
            .field("tokens", &self.entries.len())
            .field("tenants", &tenants)
            .finish_non_exhaustive()
    }
}

/// A tokens file (TOML, or JSON when the name ends in `.json`).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    admin: TokenList,
    #[serde(default)]
    tenants: BTreeMap<String, TokenList>,
}

/// One identity's tokens: plain (hashed at load) and/or SHA-256 digests;
/// for a tenant, also the caps on its modules' options.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct TokenList {
    #[serde(default)]
    tokens: Vec<String>,
    #[serde(default)]
    token_sha256: Vec<String>,
    #[serde(default)]
    limits: Option<TenantLimits>,
}

impl Auth {
    /// No tokens: the API is open.
    pub fn open() -> Self {
        Auth::default()
    }

    /// Whether no token is configured (the API is open).
    pub fn is_open(&self) -> bool {
        self.entries.is_empty()
    }

    /// Read a tokens file: TOML, or JSON when the name ends in `.json`.
    ///
    /// ```toml
    /// [admin]
    /// token_sha256 = ["<64 hex digits>"]   # `fief token hash TOKEN`
    /// [tenants.acme]
    /// tokens = ["a-plain-token-of-16-bytes-or-more"]  # hashed at load
    /// [tenants.acme.limits]                # caps on acme's module options
    /// memory_limit = "32MiB"
    /// max_live_keys = 1000
    /// allowed_dirs = ["/srv/acme:rw"]
    /// ```
    ///
    /// A tenant without `limits` gets the default [`TenantLimits`]: no cap
    /// beyond the node's own limits, and no directory.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the file and what is wrong in it.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Config(format!(
                "cannot read the tokens file {}: {e}",
                path.display()
            ))
        })?;
        let json = path.extension().is_some_and(|e| e == "json");
        Auth::parse(&text, json)
            .map_err(|e| Error::Config(format!("tokens file {}: {e}", path.display())))
    }

    /// Parse a tokens file's text (`json`: JSON, else TOML).
    ///
    /// # Errors
    ///
    /// A message saying what is wrong (never quoting a token).
    pub fn parse(text: &str, json: bool) -> std::result::Result<Self, String> {
        let file: TokensFile = if json {
            serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?
        } else {
            toml::from_str(text).map_err(|e| format!("not valid TOML: {e}"))?
        };
        let mut auth = Auth::open();
        if file.admin.limits.is_some() {
            return Err(
                "[admin] cannot have limits: caps apply to tenants ([tenants.NAME.limits])"
                    .to_owned(),
            );
        }
        auth.add_list(&file.admin, &Identity::Admin, "[admin]")?;
        for (tenant, list) in &file.tenants {
            validate_module_name(tenant).map_err(|_| {
                format!(
                    "tenant name {tenant:?} must be 1 to 128 letters, digits, '_', '-' or '.' (no '/')"
                )
            })?;
            let what = format!("[tenants.{tenant}]");
            if list.tokens.is_empty() && list.token_sha256.is_empty() {
                return Err(format!(
                    "{what} has no tokens: give `tokens` or `token_sha256`"
                ));
            }
            auth.add_list(list, &Identity::Tenant(Arc::from(tenant.as_str())), &what)?;
            auth.set_limits(tenant, list.limits.clone().unwrap_or_default());
        }
        Ok(auth)
    }

    /// Cap the options of `tenant`'s modules with `limits` (replacing any
    /// caps it had). Checked at each of the tenant's deploys.
    pub fn set_limits(&mut self, tenant: &str, limits: TenantLimits) {
        self.limits.insert(tenant.to_owned(), Arc::new(limits));
    }

    /// The caps on the deploys of `identity`: its tenant's limits (the
    /// default, directory-less [`TenantLimits`] for a tenant the file gave
    /// none), or `None` for the admin and on an open node.
    pub fn deploy_caps(&self, identity: &Identity) -> DeployCaps {
        DeployCaps(identity.tenant().map(|tenant| {
            self.limits
                .get(tenant)
                .cloned()
                .unwrap_or_else(|| Arc::new(TenantLimits::default()))
        }))
    }

    fn add_list(
        &mut self,
        list: &TokenList,
        identity: &Identity,
        what: &str,
    ) -> std::result::Result<(), String> {
        for (i, token) in list.tokens.iter().enumerate() {
            self.add_token(token, identity.clone())
                .map_err(|e| format!("{what} tokens[{i}]: {e}"))?;
        }
        for (i, hex) in list.token_sha256.iter().enumerate() {
            let digest = TokenDigest::from_hex(hex).ok_or_else(|| {
                format!("{what} token_sha256[{i}] is not 64 hex digits (see `fief token hash`)")
            })?;
            self.add_digest(digest, identity.clone())
                .map_err(|e| format!("{what} token_sha256[{i}]: {e}"))?;
        }
        Ok(())
    }

    /// Accept the plain `token` for `identity` (it is hashed at once).
    ///
    /// # Errors
    ///
    /// A message if the token is shorter than [`MIN_TOKEN_BYTES`] or is
    /// already given to another identity.
    pub fn add_token(
        &mut self,
        token: &str,
        identity: Identity,
    ) -> std::result::Result<(), String> {
        let token = token.trim();
        if token.len() < MIN_TOKEN_BYTES {
            return Err(format!(
                "a token is at least {MIN_TOKEN_BYTES} bytes (this one has {}); make one with `fief token new`",
                token.len()
            ));
        }
        self.add_digest(TokenDigest::of(token), identity)
    }

    fn add_digest(
        &mut self,
        digest: TokenDigest,
        identity: Identity,
    ) -> std::result::Result<(), String> {
        if identity == Identity::Open {
            return Err("a token cannot grant open access".to_owned());
        }
        if self.entries.iter().any(|(d, _)| d.matches(&digest)) {
            return Err("the same token is listed twice; each token names one identity".to_owned());
        }
        self.entries.push((digest, identity));
        Ok(())
    }

    /// The identity an `Authorization` header value grants.
    ///
    /// # Errors
    ///
    /// [`Error::Unauthorized`] when tokens are configured and the header is
    /// missing, not `Bearer TOKEN`, or names no known token.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Identity> {
        if self.is_open() {
            return Ok(Identity::Open);
        }
        let Some(value) = authorization else {
            return Err(Error::Unauthorized(
                "this node requires an API token: send `Authorization: Bearer TOKEN` (fief CLI: --token or FIEF_TOKEN)".to_owned(),
            ));
        };
        let token = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                Error::Unauthorized("the Authorization header must be `Bearer TOKEN`".to_owned())
            })?;
        let presented = TokenDigest::of(token);
        // Check every entry, without stopping at a match, so the time taken
        // does not say which entry (or how much of one) matched.
        let mut found = None;
        for (digest, identity) in &self.entries {
            if digest.matches(&presented) {
                found = Some(identity);
            }
        }
        found.cloned().ok_or_else(|| {
            Error::Unauthorized(
                "the API token is not valid on this node; check --token / FIEF_TOKEN".to_owned(),
            )
        })
    }
}

/// Axum middleware: authenticate the request and put its [`Identity`] in
/// the request's extensions, or answer `401` with a JSON error.
pub(crate) async fn authenticate(
    State(auth): State<Arc<Auth>>,
    mut request: Request,
    next: Next,
) -> Response {
    let header = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or(""));
    match auth.authenticate(header) {
        Ok(identity) => {
            let caps = auth.deploy_caps(&identity);
            request.extensions_mut().insert(identity);
            request.extensions_mut().insert(caps);
            next.run(request).await
        }
        Err(e) => {
            tracing::debug!(path = %request.uri().path(), error = %e, "refused an API request");
            let mut response = e.into_response();
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth() -> Auth {
        Auth::parse(
            &format!(
                r#"
                [admin]
                tokens = ["admin-token-0123456789"]
                [tenants.acme]
                token_sha256 = ["{}"]
                [tenants.globex]
                tokens = ["globex-token-0123456789"]
                "#,
                hash_token("acme-token-0123456789")
            ),
            false,
        )
        .unwrap()
    }

    #[test]
    fn tokens_map_to_identities() {
        let auth = auth();
        let who = |t: &str| auth.authenticate(Some(&format!("Bearer {t}")));
        assert_eq!(who("admin-token-0123456789").unwrap(), Identity::Admin);
        assert_eq!(
            who("acme-token-0123456789").unwrap(),
            Identity::Tenant("acme".into())
        );
        assert_eq!(
            who("globex-token-0123456789").unwrap().tenant(),
            Some("globex")
        );
        // A token sharing a long prefix with a valid one is still refused.
        assert_eq!(
            who("acme-token-012345678").unwrap_err().code(),
            "unauthorized"
        );
        assert_eq!(auth.authenticate(None).unwrap_err().http_status(), 401);
        let basic = auth.authenticate(Some("Basic abc")).unwrap_err();
        assert!(basic.to_string().contains("Bearer"), "{basic}");
        assert_eq!(Auth::open().authenticate(None).unwrap(), Identity::Open);
    }

    #[test]
    fn digests_compare_in_constant_time_and_debug_redacts() {
        // `matches` is `subtle::ConstantTimeEq` over the whole digest.
        let a = TokenDigest::of("x-token-0123456789");
        let b = TokenDigest::of("x-token-0123456789");
        let c = TokenDigest::of("y-token-0123456789");
        assert!(a.matches(&b) && !a.matches(&c));
        let shown = format!("{:?} {:?}", auth(), a);
        for secret in [
            "admin-token",
            "globex-token",
            &hash_token("acme-token-0123456789"),
        ] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(
            shown.contains("acme") && shown.contains("redacted"),
            "{shown}"
        );
    }

    #[test]
    fn bad_tokens_files_are_refused_with_reasons() {
        let err = Auth::parse("[tenants.acme]\ntokens = [\"short\"]", false).unwrap_err();
        assert!(err.contains("at least 16 bytes"), "{err}");
        assert!(!err.contains("short\""), "{err}");
        let err = Auth::parse("[tenants.acme]\ntoken_sha256 = [\"zz\"]", false).unwrap_err();
        assert!(err.contains("64 hex digits"), "{err}");
        let err = Auth::parse(
            "[admin]\ntokens = [\"0123456789abcdef\"]\n[admin.limits]\nmax_live_keys = 1",
            false,
        )
        .unwrap_err();
        assert!(err.contains("[admin] cannot have limits"), "{err}");
        let err = Auth::parse(
            "[tenants.acme]\ntokens = [\"0123456789abcdef\"]\n[tenants.acme.limits]\nmemory = 1",
            false,
        )
        .unwrap_err();
        assert!(err.contains("memory"), "an unknown cap is named: {err}");
        let err =
            Auth::parse("[tenants.\"a/b\"]\ntokens = [\"0123456789abcdef\"]", false).unwrap_err();
        assert!(err.contains("tenant name"), "{err}");
        let err = Auth::parse(
            "[admin]\ntokens = [\"0123456789abcdef\"]\n[tenants.a]\ntokens = [\"0123456789abcdef\"]",
            false,
        )
        .unwrap_err();
        assert!(err.contains("twice"), "{err}");
        let err = Auth::parse("[tenants.acme]\n", false).unwrap_err();
        assert!(err.contains("no tokens"), "{err}");
        let json = r#"{"tenants": {"acme": {"tokens": ["0123456789abcdef"]}}}"#;
        assert!(!Auth::parse(json, true).unwrap().is_open());
    }

    #[test]
    fn names_are_scoped_per_tenant() {
        let acme = Identity::Tenant("acme".into());
        assert_eq!(acme.module("counter").unwrap(), "acme/counter");
        assert_eq!(acme.module("acme/counter").unwrap(), "acme/counter");
        assert_eq!(
            acme.module("globex/counter").unwrap_err().http_status(),
            404
        );
        assert_eq!(
            acme.visible_module("acme/counter").as_deref(),
            Some("counter")
        );
        assert_eq!(acme.visible_module("globex/counter"), None);
        assert_eq!(acme.visible_module("counter"), None);
        assert_eq!(acme.cache_namespace("s").unwrap(), "acme/s");
        assert!(acme.cache_namespace("globex/s").is_err());
        assert_eq!(acme.require_admin("leave").unwrap_err().http_status(), 403);
        assert_eq!(Identity::Open.module("a/b").unwrap_err().http_status(), 400);
        assert_eq!(
            Identity::Admin.module("acme/counter").unwrap(),
            "acme/counter"
        );
        assert_eq!(guest_module("acme/x", "counter").unwrap(), "acme/counter");
        assert!(guest_module("acme/x", "globex/counter").is_err());
        assert_eq!(
            guest_module("x", "globex/counter").unwrap(),
            "globex/counter"
        );
        assert_eq!(guest_scoped("acme/x", "news"), "acme/news");
        assert_eq!(guest_scoped("x", "news"), "news");
    }
}
