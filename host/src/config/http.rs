//! The API's time limits as a node is configured with them: the defaults
//! and ceilings of `http_header_read_timeout`, `http_idle_timeout` and
//! `http_body_read_timeout`, and the checks of the HTTP options that do not
//! depend on the process (part of [`NodeConfig::validate`]).
//!
//! Plain values and a pure check: `crate::http_limits` resolves the
//! connection cap against the open-file limit and `crate::listener` keeps the
//! limits on connections; both import what is here. This file must not read
//! the process's limits nor touch a connection.

use std::time::Duration;

use super::NodeConfig;
use crate::error::{Error, Result};

/// Default of `http_header_read_timeout`.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of `http_idle_timeout`.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Ceiling of `http_header_read_timeout`.
pub const MAX_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(300);
/// Default of `http_body_read_timeout`.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Ceiling of `http_body_read_timeout`.
pub const MAX_BODY_READ_TIMEOUT: Duration = Duration::from_secs(300);
/// Ceiling of `http_idle_timeout`.
pub const MAX_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

impl NodeConfig {
    /// The checks of the HTTP options that do not depend on the process's
    /// limits (part of [`NodeConfig::validate`]; the connection cap against
    /// the open-file limit is `crate::http_limits`'s).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the value and its bounds.
    pub(crate) fn validate_http(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        for (name, value, ceiling) in [
            (
                "http_header_read_timeout",
                self.http_header_read_timeout,
                MAX_HEADER_READ_TIMEOUT,
            ),
            (
                "http_idle_timeout",
                self.http_idle_timeout,
                MAX_IDLE_TIMEOUT,
            ),
            (
                "http_body_read_timeout",
                self.http_body_read_timeout,
                MAX_BODY_READ_TIMEOUT,
            ),
        ] {
            if value.is_zero() || value > ceiling {
                return bad(format!(
                    "{name} ({value:?}) must be above zero and at most {ceiling:?}: a connection that holds \
                     the node longer is an attack or a broken client"
                ));
            }
        }
        if self.http_max_connections == Some(0) {
            return bad(
                "http_max_connections (0) must be at least 1; leave it out for the automatic cap"
                    .to_owned(),
            );
        }
        Ok(())
    }
}
