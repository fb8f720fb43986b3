//! The compile worker's settings as a node is configured with them: the
//! default and floor of `compile_memory_limit`, and the check of
//! `compile_memory_limit` and `compile_timeout` (part of
//! [`NodeConfig::validate`]).
//!
//! Plain values and a pure check: the worker itself and the node's side of
//! it are `crate::compile_worker`'s, which imports what is here. This file
//! must not start, kill or talk to a process.

use bytesize::ByteSize;

use super::NodeConfig;
use crate::error::{Error, Result};

/// Default of `compile_memory_limit`. Measured with a debug build (the
/// worker's peak address space, `VmPeak`, and resident memory): the counter
/// example (96 KB) 250 MiB and 35 MiB, componentize-py's counter (18 MB)
/// 650 MiB and 410 MiB, componentize-js's (12 MB) 600 MiB and 470 MiB.
pub const DEFAULT_MEMORY_LIMIT: ByteSize = ByteSize::gib(4);

/// The least `compile_memory_limit` a worker can start in and compile a
/// small module (its binary, thread stacks and allocator arenas are address
/// space too: 250 MiB for the counter example).
pub const MIN_MEMORY_LIMIT: ByteSize = ByteSize::mib(512);

impl NodeConfig {
    /// Check the compile worker's settings (part of
    /// [`NodeConfig::validate`]).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the value and the way out.
    pub(crate) fn validate_compile(&self) -> Result<()> {
        if self.compile_memory_limit < MIN_MEMORY_LIMIT {
            return Err(Error::Config(format!(
                "compile_memory_limit ({}) must be at least {MIN_MEMORY_LIMIT}: a compile worker \
                 needs that much address space to start",
                self.compile_memory_limit
            )));
        }
        if self.compile_timeout.is_zero() {
            return Err(Error::Config(
                "compile_timeout must be above zero (e.g. 300s)".to_owned(),
            ));
        }
        Ok(())
    }
}
