//! [`MemoryInit`]: how a key's linear memory gets its module's initial data
//! when the key starts, as a configuration writes it (`memory_init =
//! "copy"`).
//!
//! A plain value: the node's and the compile worker's engines are built
//! with it (`crate::compile_worker::engine_config`). This file must not
//! build or configure anything.

use serde::{Deserialize, Serialize};

/// How each key's linear memory is given its module's initial data (its
/// data segments) when the key starts. The trade-off, measured in
/// docs/benchmarks.md ("Issue 20, eighteenth pass"): copying wins for
/// guests with small data images (a Rust guest's few KiB), mapping wins for
/// interpreters' large snapshots (a Python or JavaScript guest's MiBs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryInit {
    /// Map the module's data image into each key's memory copy-on-write
    /// (wasmtime's default): a key pays only for the pages it writes, and
    /// pages it only reads are shared between keys. A page a key first
    /// reads and then writes is replaced under the other cores' feet, which
    /// costs an interrupt to every core running a thread of the node
    /// (TLB shootdown): under heavy activation churn on a busy node that is
    /// about a third of an activation's cost. The default, and the setting for
    /// Python and JavaScript guests (a copy of their snapshot at every
    /// activation costs milliseconds).
    #[default]
    CopyOnWrite,
    /// Copy the module's data segments into each key's fresh memory when it
    /// starts: no shared pages, so no shootdowns, and two memory mappings
    /// per live key instead of four. For nodes whose guests have small
    /// data images and activate often (eviction under a live budget):
    /// measured with a Rust guest of an 8 KiB image, 36–114 % more
    /// activations a second under churn (five pairs of runs) and a third
    /// off a reactivation, at the same RSS; but a Python guest's activation
    /// takes 7× as long.
    Copy,
}

impl std::str::FromStr for MemoryInit {
    type Err = String;

    fn from_str(text: &str) -> Result<MemoryInit, String> {
        match text.trim() {
            "copy-on-write" => Ok(MemoryInit::CopyOnWrite),
            "copy" => Ok(MemoryInit::Copy),
            other => Err(format!(
                "{other:?} is not a way to initialise memory: write copy-on-write (the \
                 default: each key maps its module's data image) or copy (each key copies \
                 its module's data segments: for small Rust-sized images and heavy \
                 activation churn)"
            )),
        }
    }
}

impl std::fmt::Display for MemoryInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemoryInit::CopyOnWrite => "copy-on-write",
            MemoryInit::Copy => "copy",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_settings_read_and_print_the_same() {
        for init in [MemoryInit::CopyOnWrite, MemoryInit::Copy] {
            assert_eq!(init.to_string().parse::<MemoryInit>(), Ok(init));
        }
        let why = "mmap".parse::<MemoryInit>().expect_err("no such setting");
        assert!(
            why.contains("\"mmap\"") && why.contains("copy-on-write"),
            "{why}"
        );
    }
}
