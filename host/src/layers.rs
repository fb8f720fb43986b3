//! The layer table of `ARCHITECTURE.md` ("Layers inside `fief`"), as data,
//! and the test that holds every file of `host/src` to it.
//!
//! A file may import its own row and the rows below, never a row above. The
//! test reads each file's `crate::…` and `super::…` paths — in `use` trees
//! and in code, comments and string literals left out — resolves them to
//! the module they name (through `lib.rs`'s re-exports for `crate::Name`),
//! and fails naming the file, the line, the path and the rule. A file the
//! table does not place fails too: a new module is given its row here, and
//! in `ARCHITECTURE.md`, when it is added.
//!
//! Test code only (`#[cfg(test)]`): it reads the sources from
//! `CARGO_MANIFEST_DIR` and must not be linked into the crate.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A row of the table, lowest first: a file may import its own row and
/// those before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Row {
    /// Plain values and leaves: they import only `fief-core`, and each
    /// other.
    Values,
    /// Policy, ledgers, meters, stores and adapters.
    Ledgers,
    /// A key's parts: mailbox, limbo, pub/sub, the engine and module
    /// compilation; and the key layer's shared types they name.
    KeyParts,
    /// Key processes, the host imports and the event log; they reach the
    /// node only through `key/services.rs`.
    Keys,
    /// The node, its API and the fuzz targets' entry points.
    Node,
    /// `lib.rs`: it re-exports every row.
    Root,
}

impl Row {
    fn name(self) -> &'static str {
        match self {
            Row::Values => "values",
            Row::Ledgers => "policy, ledgers, adapters",
            Row::KeyParts => "a key's parts",
            Row::Keys => "key processes",
            Row::Node => "the node",
            Row::Root => "the crate root",
        }
    }
}

/// Which row each module is in: a module path (`cache::store`, or an item,
/// `key::KeyCtx`) and its row. The longest prefix that matches wins, so a
/// file under `node/` is the node's and `key::KeyCtx` is importable from the
/// row of a key's parts, where `key::slot` is not.
const TABLE: &[(&str, Row)] = &[
    ("", Row::Root),
    // The node.
    ("node", Row::Node),
    ("transport", Row::Node),
    ("http", Row::Node),
    ("http_modules", Row::Node),
    ("listener", Row::Node),
    ("dashboard", Row::Node),
    ("dashboard_history", Row::Node),
    ("probes", Row::Node),
    ("openapi", Row::Node),
    ("fuzz", Row::Node),
    // Key processes.
    ("key", Row::Keys),
    ("host_api", Row::Keys),
    ("storage_api", Row::Keys),
    ("connections_api", Row::Keys),
    ("event_log", Row::Keys),
    // A key's parts, and the key layer's shared types they may name: the
    // store's data type their linker is built for (`KeyCtx`), a queued
    // message (`Envelope`) and a key's kill switch (`KeyControl`).
    ("limbo", Row::KeyParts),
    ("mailbox", Row::KeyParts),
    ("pubsub", Row::KeyParts),
    ("connections", Row::KeyParts),
    ("module", Row::KeyParts),
    ("runtime", Row::KeyParts),
    ("key::KeyCtx", Row::KeyParts),
    ("key::Envelope", Row::KeyParts),
    ("key::KeyControl", Row::KeyParts),
    // Policy, ledgers, adapters.
    ("sandbox", Row::Ledgers),
    ("auth", Row::Ledgers),
    ("guest_log", Row::Ledgers),
    ("cpu_budget", Row::Ledgers),
    ("scheduler", Row::Ledgers),
    ("guest_priority", Row::Ledgers),
    ("inline_share", Row::Ledgers),
    ("request_turns", Row::Ledgers),
    ("host_bytes", Row::Ledgers),
    ("handoff", Row::Ledgers),
    ("peer_auth", Row::Ledgers),
    ("storage", Row::Ledgers),
    ("arbiter", Row::Ledgers),
    ("cache", Row::Ledgers),
    ("metrics", Row::Ledgers),
    ("compile_cache", Row::Ledgers),
    ("compile_worker", Row::Ledgers),
    ("load_ceilings", Row::Ledgers),
    ("http_limits", Row::Ledgers),
    ("heap_trim", Row::Ledgers),
    ("tls", Row::Ledgers),
    // Values and leaves.
    ("config", Row::Values),
    ("wire", Row::Values),
    ("trace", Row::Values),
    ("error", Row::Values),
    ("clock", Row::Values),
    ("sync", Row::Values),
    ("line_budget", Row::Values),
    ("tick_wakes", Row::Values),
    ("token_bucket", Row::Values),
    ("dedicated", Row::Values),
    ("bindings", Row::Values),
    // This test, which imports nothing of the crate.
    ("layers", Row::Values),
];

/// Files held to less than their row: the module and the only modules of
/// the crate it may import.
const ONLY: &[(&str, &[&str])] = &[
    // The public error imports nothing of the crate: a part's own error
    // becomes an `Error` in that part.
    ("error", &[]),
    // Every value one node sends another; no decisions, nothing but errors.
    ("wire", &["error"]),
    // This test reads files; it needs nothing of the crate.
    ("layers", &[]),
];

/// Where ARCHITECTURE.md states the rule, for the failure messages.
const RULE: &str = "a file imports only its own row and the rows below (ARCHITECTURE.md, \
     \"Layers inside `fief`\"; the table is TABLE in host/src/layers.rs)";

/// `src` with comments and the insides of string and character literals
/// blanked out (newlines kept, so offsets and line numbers stay).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            let end = b[i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |n| i + n);
            blank(&mut out, i, end);
            i = end;
        } else if b[i..].starts_with(b"/*") {
            let (mut depth, mut j) = (0, i);
            while j < b.len() {
                if b[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if b[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if (b[i] == b'r' || b[i..].starts_with(b"br")) && (i == 0 || !ident(b[i - 1])) {
            // A raw string: r"…", r#"…"#, br"…".
            let start = if b[i] == b'b' { i + 2 } else { i + 1 };
            let hashes = b[start..].iter().take_while(|&&c| c == b'#').count();
            if b.get(start + hashes) != Some(&b'"') {
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let body = start + hashes + 1;
            let end = b[body..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(b.len(), |n| body + n + close.len());
            blank(&mut out, i, end);
            i = end;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            blank(&mut out, i, end);
            i = end;
        } else if b[i] == b'\'' {
            // A character literal ('x', '\n', '\''), not a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                let end = b[i + 3..]
                    .iter()
                    .position(|&c| c == b'\'')
                    .map_or(b.len(), |n| i + 3 + n + 1);
                blank(&mut out, i, end);
                i = end;
            } else if b.get(i + 2) == Some(&b'\'') {
                blank(&mut out, i, i + 3);
                i += 3;
            } else {
                // A lifetime, or a multi-byte character: skip its first byte.
                let len = src[i + 1..].chars().next().map_or(0, char::len_utf8);
                if b.get(i + 1 + len) == Some(&b'\'') {
                    blank(&mut out, i, i + 2 + len);
                    i += 2 + len;
                } else {
                    i += 1;
                }
            }
        } else {
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The paths a `use` tree names (`a::{b, c::{self, D as E}}`), each with
/// the name it binds (its alias or last segment).
fn expand(tree: &str) -> Vec<(Vec<String>, String)> {
    let mut tokens = Vec::new();
    let mut chars = tree.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '{' | '}' | ',' | '*' => tokens.push(c.to_string()),
            ':' if chars.peek().is_some_and(|&(_, n)| n == ':') => {
                chars.next();
                tokens.push("::".to_owned());
            }
            c if c.is_alphanumeric() || c == '_' => {
                let mut end = at + c.len_utf8();
                while let Some(&(n_at, n)) = chars.peek() {
                    if n.is_alphanumeric() || n == '_' {
                        end = n_at + n.len_utf8();
                        chars.next();
                    } else {
                        break;
                    }
                }
                tokens.push(tree[at..end].to_owned());
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    let mut at = 0;
    parse_trees(&tokens, &mut at, &[], &mut out);
    out
}

/// Parse comma-separated use trees from `tokens[*at..]` under `prefix`,
/// until a `}` or the end.
fn parse_trees(
    tokens: &[String],
    at: &mut usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, String)>,
) {
    while *at < tokens.len() {
        let mut path = prefix.to_vec();
        while let Some(token) = tokens.get(*at) {
            match token.as_str() {
                "{" => {
                    *at += 1;
                    parse_trees(tokens, at, &path, out);
                    *at += 1; // the `}`
                    break;
                }
                "}" | "," => break,
                "::" => *at += 1,
                "as" => {
                    let alias = tokens.get(*at + 1).cloned().unwrap_or_default();
                    *at += 2;
                    out.push((path.clone(), alias));
                    path.clear();
                }
                "*" => {
                    *at += 1;
                    out.push((path.clone(), "*".to_owned()));
                    path.clear();
                }
                segment => {
                    *at += 1;
                    let next = tokens.get(*at).map(String::as_str);
                    if segment != "self" {
                        path.push(segment.to_owned());
                    }
                    if matches!(next, None | Some("}" | ",")) {
                        let name = path.last().cloned().unwrap_or_default();
                        out.push((path.clone(), name));
                        path.clear();
                    }
                }
            }
        }
        match tokens.get(*at).map(String::as_str) {
            Some(",") => *at += 1,
            _ => return,
        }
    }
}

/// The module path of the file at `rel` (relative to `host/src`):
/// `key/slot.rs` is `key::slot`, `key/mod.rs` is `key`, `lib.rs` is the root.
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_owned)
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// One path a file names: where, and the module path it resolves to.
#[derive(Debug, PartialEq, Eq)]
struct Named {
    line: usize,
    path: Vec<String>,
}

/// The paths of the crate that the file at `rel` names in `src`.
fn named_paths(rel: &str, src: &str) -> Vec<Named> {
    let code = strip(src);
    let file_module = module_of(rel);
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    // Inline modules (`mod tests { … }`): their spans and names, for `super`.
    let mut inline = Vec::new();
    let mut children: Vec<String> = Vec::new();
    for (at, _) in code.match_indices("mod ") {
        if code[..at].ends_with(is_ident) {
            continue;
        }
        let rest = &code[at + 4..];
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|&c| is_ident(c))
            .collect();
        let after = rest.trim_start()[name.len()..].trim_start();
        if after.starts_with(';') {
            children.push(name);
        } else if after.starts_with('{') {
            let open = code.len() - after.len();
            let mut depth = 0;
            let mut close = code.len();
            for (i, c) in code[open..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            close = open + i;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            inline.push((open, close, name));
        }
    }
    let module_at = |offset: usize| -> Vec<String> {
        let mut m = file_module.clone();
        m.extend(
            inline
                .iter()
                .filter(|(open, close, _)| *open <= offset && offset <= *close)
                .map(|(_, _, name)| name.clone()),
        );
        m
    };
    let line_of = |offset: usize| code[..offset].matches('\n').count() + 1;
    // `crate::a`, `super::super::a`, or a child module `a` declared here.
    let resolve = |offset: usize, path: &[String]| -> Option<Vec<String>> {
        match path.first().map(String::as_str) {
            Some("crate") => Some(path[1..].to_vec()),
            Some("super") => {
                let mut base = module_at(offset);
                let supers = path.iter().take_while(|s| *s == "super").count();
                base.truncate(base.len().saturating_sub(supers));
                base.extend_from_slice(&path[supers..]);
                Some(base)
            }
            Some(first) if children.iter().any(|c| c == first) => {
                let mut base = module_at(offset);
                base.extend_from_slice(path);
                Some(base)
            }
            _ => None,
        }
    };
    let mut out = Vec::new();
    let mut use_spans = Vec::new();
    for (at, _) in code.match_indices("use ") {
        if code[..at].ends_with(is_ident) {
            continue;
        }
        let end = code[at..].find(';').map_or(code.len(), |n| at + n);
        use_spans.push((at, end));
        for (path, _) in expand(&code[at + 4..end]) {
            if let Some(path) = resolve(at, &path) {
                out.push(Named {
                    line: line_of(at),
                    path,
                });
            }
        }
    }
    for head in ["crate::", "super::"] {
        for (at, _) in code.match_indices(head) {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| is_ident(c) || c == ':' || c == '$')
                || use_spans.iter().any(|&(from, to)| from <= at && at <= to)
            {
                continue;
            }
            let text: String = code[at..]
                .chars()
                .take_while(|&c| is_ident(c) || c == ':')
                .collect();
            let path: Vec<String> = text
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            if let Some(path) = resolve(at, &path) {
                out.push(Named {
                    line: line_of(at),
                    path,
                });
            }
        }
    }
    out
}

/// The row of a module path: its longest prefix in [`TABLE`].
fn row_of(path: &[String]) -> Option<(Row, String)> {
    (0..=path.len()).rev().find_map(|n| {
        let prefix = path[..n].join("::");
        TABLE
            .iter()
            .find(|(module, _)| *module == prefix)
            .map(|&(_, row)| (row, prefix))
    })
}

/// `lib.rs`'s re-exports: the name each binds at the crate root, and the
/// path it stands for (`Instance` → `node::Instance`).
fn reexports(lib: &str) -> HashMap<String, Vec<String>> {
    let code = strip(lib);
    let mut map = HashMap::new();
    for (at, _) in code.match_indices("pub use ") {
        let end = code[at..].find(';').map_or(code.len(), |n| at + n);
        for (path, name) in expand(&code[at + 8..end]) {
            map.insert(name, path);
        }
    }
    map
}

/// The rule breaks of the file at `rel` (relative to `host/src`) with
/// source `src`, each as a message naming the file, line, path and rule.
fn check_file(rel: &str, src: &str, reexports: &HashMap<String, Vec<String>>) -> Vec<String> {
    let module = module_of(rel);
    let Some((row, _)) = row_of(&module).filter(|(_, p)| !p.is_empty() || module.is_empty()) else {
        return vec![format!(
            "host/src/{rel}: no row of the layer table holds module `{}`; give it one in \
             TABLE (host/src/layers.rs) and in ARCHITECTURE.md's table",
            module.join("::")
        )];
    };
    let only = ONLY
        .iter()
        .find(|(m, _)| module.first().map(String::as_str) == Some(*m));
    let mut breaks = Vec::new();
    for named in named_paths(rel, src) {
        let mut path = named.path.clone();
        // `crate::Name` through lib.rs's re-exports.
        if let Some(first) = path.first()
            && row_of(&path).is_none_or(|(_, prefix)| prefix.is_empty())
            && let Some(target) = reexports.get(first)
        {
            path = target.iter().chain(&path[1..]).cloned().collect();
        }
        if path.first().is_some_and(|f| f == "fief_core") || path.starts_with(&module) {
            continue;
        }
        let shown = format!("crate::{}", named.path.join("::"));
        let Some((target, prefix)) = row_of(&path).filter(|(_, p)| !p.is_empty()) else {
            breaks.push(format!(
                "host/src/{rel}:{}: `{shown}` names no module of the layer table",
                named.line
            ));
            continue;
        };
        if target > row {
            breaks.push(format!(
                "host/src/{rel}:{}: `{shown}`: `{}` is in the row \"{}\", `{prefix}` in \"{}\" \
                 above it; {RULE}",
                named.line,
                module.join("::"),
                row.name(),
                target.name(),
            ));
        } else if let Some((m, allowed)) = only
            && !allowed.iter().any(|a| path.first().is_some_and(|f| f == a))
        {
            breaks.push(format!(
                "host/src/{rel}:{}: `{shown}`: `{m}` may import only {allowed:?} of the crate \
                 (ONLY in host/src/layers.rs; ARCHITECTURE.md, \"Layers inside `fief`\")",
                named.line,
            ));
        }
    }
    breaks
}

/// Every `.rs` file under `dir`, relative to it, but the binary's (`bin/`,
/// where `crate` is the `fief` binary).
fn sources(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = vec![dir.to_owned()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).expect("a source directory").flatten() {
            let path = entry.path();
            let rel = path
                .strip_prefix(dir)
                .expect("under src")
                .to_string_lossy()
                .replace('\\', "/");
            if path.is_dir() {
                if rel != "bin" {
                    dirs.push(path);
                }
            } else if rel.ends_with(".rs") {
                out.push(rel);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_file_imports_only_its_own_row_and_the_rows_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let read = |rel: &str| std::fs::read_to_string(src.join(rel)).expect("a source file");
    let reexports = reexports(&read("lib.rs"));
    let files = sources(&src);
    assert!(files.len() > 50, "found only {files:?} under {src:?}");
    let mut breaks: Vec<String> = files
        .iter()
        .flat_map(|rel| check_file(rel, &read(rel), &reexports))
        .collect();
    // And the table names no module that is gone (its items, `key::KeyCtx`,
    // are checked by the compiler where they are imported).
    for (module, _) in TABLE {
        let file = module.replace("::", "/");
        if !module.is_empty()
            && !module.contains(|c: char| c.is_ascii_uppercase())
            && !files.contains(&format!("{file}.rs"))
            && !files.contains(&format!("{file}/mod.rs"))
        {
            breaks.push(format!(
                "TABLE in host/src/layers.rs names `{module}`, which is no file of host/src"
            ));
        }
    }
    assert!(
        breaks.is_empty(),
        "imports against the layer table:\n{}",
        breaks.join("\n")
    );
}

#[test]
fn an_import_from_a_row_above_is_caught() {
    let reexports = reexports("pub use node::{Instance, Status};\npub use fief_core as core;");
    let src = "//! A meter.\n\
               use crate::sync::lock;\n\
               use crate::{config::CpuShare, node::{self, Status}};\n\
               fn f() { let _ = crate::Instance::start; }\n";
    let breaks = check_file("cpu_budget.rs", src, &reexports);
    assert_eq!(breaks.len(), 3, "{breaks:#?}");
    assert!(
        breaks[0].starts_with("host/src/cpu_budget.rs:3: `crate::node`")
            && breaks[0].contains("\"policy, ledgers, adapters\"")
            && breaks[0].contains("`node` in \"the node\" above it"),
        "{}",
        breaks[0]
    );
    assert!(breaks[1].contains("`crate::node::Status`"), "{}", breaks[1]);
    assert!(
        breaks[2].starts_with("host/src/cpu_budget.rs:4: `crate::Instance::start`"),
        "{}",
        breaks[2]
    );
    // A key's part may name the key layer's shared types, and no more.
    let src = "use crate::key::{KeyCtx, slot::ModuleSlot};";
    let breaks = check_file("runtime.rs", src, &reexports);
    assert_eq!(breaks.len(), 1, "{breaks:#?}");
    assert!(breaks[0].contains("`crate::key::slot::ModuleSlot`"));
    // wire.rs imports nothing but error, even of its own row.
    let breaks = check_file(
        "wire.rs",
        "use crate::{error::Error, config::NodeConfig};",
        &reexports,
    );
    assert_eq!(breaks.len(), 1, "{breaks:#?}");
    assert!(breaks[0].contains("`wire` may import only [\"error\"]"));
    // A file the table does not place.
    let breaks = check_file("brand_new.rs", "", &reexports);
    assert!(
        breaks[0].contains("no row of the layer table"),
        "{breaks:?}"
    );
}

#[test]
fn paths_are_read_from_use_trees_and_code_but_not_comments_or_strings() {
    let src = r#"//! See crate::node::Status.
use std::sync::Arc;
use crate::{a::{self, B as C}, d::*};
use super::e::F;
mod child;
use child::G;
/// [`crate::node`] in a doc comment.
fn f() -> crate::h::I {
    let _ = "crate::node in a string";
    let _ = r"crate::node in a raw string";
    let _ = '"'; let _: &'static str = "";
    crate::j::k();
}
#[cfg(test)]
mod tests {
    use super::*;
    use super::super::l::M;
}
"#;
    let paths: Vec<(usize, String)> = named_paths("x/y.rs", src)
        .into_iter()
        .map(|n| (n.line, n.path.join("::")))
        .collect();
    let expect = [
        (3, "a"),
        (3, "a::B"),
        (3, "d"),
        (4, "x::e::F"),
        (6, "x::y::child::G"),
        (16, "x::y"),
        (17, "x::l::M"),
        (8, "h::I"),
        (12, "j::k"),
    ];
    let expect: Vec<(usize, String)> = expect.iter().map(|&(l, p)| (l, p.to_owned())).collect();
    assert_eq!(paths, expect);
}
