//! A host directory granted to a module's keys (the `dir` option): its
//! written form, its parsing and the checks on it as a value.
//!
//! It is configuration, nothing more: this file must not build a sandbox.
//! What the grant opens inside a key, and the caps a tenant's grants must
//! stay under, are `crate::sandbox`'s, which sits above `config` and imports
//! this type (never the other way).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};

/// One host directory granted to a module's keys, read-only or read-write.
///
/// Written `"/srv/data:ro"` or `"/srv/data:rw"` (a path without a suffix is
/// read-only). The path must be absolute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirGrant {
    /// The directory on the node's host.
    pub host: PathBuf,
    /// Whether keys may create, write and delete files in it.
    pub writable: bool,
}

impl FromStr for DirGrant {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (path, writable) = match s.rsplit_once(':') {
            Some((path, "ro")) => (path, false),
            Some((path, "rw")) => (path, true),
            _ => (s, false),
        };
        let host = PathBuf::from(path);
        if !host.is_absolute() {
            return Err(format!(
                "dir {s:?}: the host directory must be an absolute path, written \
                 /path:ro (read-only) or /path:rw (read-write)"
            ));
        }
        Ok(DirGrant { host, writable })
    }
}

impl fmt::Display for DirGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = if self.writable { "rw" } else { "ro" };
        write!(f, "{}:{mode}", self.host.display())
    }
}

impl Serialize for DirGrant {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DirGrant {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl DirGrant {
    /// Check, at deploy, that the directory exists and is a directory.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] naming the path and what is wrong.
    pub fn check_exists(&self) -> Result<()> {
        match std::fs::metadata(&self.host) {
            Ok(m) if m.is_dir() => Ok(()),
            Ok(_) => Err(Error::InvalidOptions(format!(
                "dir {}: not a directory",
                self.host.display()
            ))),
            Err(e) => Err(Error::InvalidOptions(format!(
                "dir {}: {e}; create the directory on every node first",
                self.host.display()
            ))),
        }
    }

    /// Whether `self` lies within `outer` (after resolving `..` and symbolic
    /// links) and asks for no more permission than it.
    pub(crate) fn within(&self, outer: &DirGrant) -> bool {
        let (Ok(inner_path), Ok(outer_path)) = (
            std::fs::canonicalize(&self.host),
            std::fs::canonicalize(&outer.host),
        ) else {
            return false;
        };
        inner_path.starts_with(&outer_path) && (outer.writable || !self.writable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_grants_parse_and_refuse_relative_paths() {
        let ro: DirGrant = "/srv/data:ro".parse().unwrap();
        assert_eq!(ro.host, PathBuf::from("/srv/data"));
        assert!(!ro.writable);
        let rw: DirGrant = "/srv/data:rw".parse().unwrap();
        assert!(rw.writable);
        assert_eq!(rw.to_string(), "/srv/data:rw");
        let bare: DirGrant = "/srv/data".parse().unwrap();
        assert!(!bare.writable);
        let err = "data:ro".parse::<DirGrant>().unwrap_err();
        assert!(err.contains("absolute"), "{err}");
    }
}
