//! Key and module names: what a valid one is, and the error that says why
//! one is not.

use super::MAX_KEY_BYTES;
use crate::error::{Error, Result};

/// Check a key name.
///
/// # Errors
///
/// [`Error::InvalidKey`] when it is empty or over [`MAX_KEY_BYTES`].
pub fn validate_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidKey("a key must not be empty".to_owned()));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::InvalidKey(format!(
            "a key is at most {MAX_KEY_BYTES} bytes; this one is {} bytes",
            key.len()
        )));
    }
    Ok(())
}

/// Check a module name: 1–128 characters of `[a-zA-Z0-9_.-]`.
///
/// # Errors
///
/// [`Error::InvalidModuleName`] saying what is wrong.
pub fn validate_module_name(name: &str) -> Result<()> {
    let why = if name.is_empty() || name.len() > 128 {
        Some("a module name is 1 to 128 characters long")
    } else if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        Some("a module name uses only letters, digits, '_', '-' and '.'")
    } else if !name.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
        // `.` and `..` name no module in a path or URL, and `-x` reads as a
        // flag to the CLI: such a module could be deployed but not called.
        Some("a module name starts with a letter, a digit or '_'")
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::InvalidModuleName {
            name: name.to_owned(),
            why: why.to_owned(),
        }),
        None => Ok(()),
    }
}

/// Check a stored module name: a plain name (see [`validate_module_name`])
/// or a tenant's `tenant/name`, both parts plain names
/// ([`crate::auth`]).
///
/// # Errors
///
/// [`Error::InvalidModuleName`] saying what is wrong.
pub fn validate_qualified_module_name(name: &str) -> Result<()> {
    match name.split_once('/') {
        None => validate_module_name(name),
        Some((tenant, local)) => {
            if validate_module_name(tenant).is_err() || validate_module_name(local).is_err() {
                return Err(Error::InvalidModuleName {
                    name: name.to_owned(),
                    why: "a tenant's module is `tenant/name`, each part 1 to 128 letters, digits, '_', '-' or '.'".to_owned(),
                });
            }
            Ok(())
        }
    }
}
