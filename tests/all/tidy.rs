//! Tidy checks on the docs: every test named in a "Verified by" line of
//! `docs/design.md` or `docs/fencing.md` exists (house style: the docs cite
//! the tests that hold each guarantee, and the citation must not rot).

use std::path::Path;

/// Every `path::function` reference in backticks in `doc`.
fn cited_tests(doc: &str) -> Vec<(String, String)> {
    doc.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|span| span.split_once("::"))
        .filter(|(file, name)| {
            file.ends_with(".rs")
                && !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
        .map(|(file, name)| (file.to_owned(), name.to_owned()))
        .collect()
}

fn check(doc_path: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let Ok(doc) = std::fs::read_to_string(root.join(doc_path)) else {
        panic!("{doc_path} is missing");
    };
    assert!(!cited_tests(&doc).is_empty(), "{doc_path} names no tests");
    check_citations(doc_path, &doc);
}

/// Every test `doc` cites exists.
fn check_citations(doc_path: &str, doc: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cited = cited_tests(doc);
    let mut missing = Vec::new();
    for (file, name) in cited {
        let source = std::fs::read_to_string(root.join(&file)).unwrap_or_default();
        if !source.contains(&format!("fn {name}(")) {
            missing.push(format!("{file}::{name}"));
        }
    }
    assert!(
        missing.is_empty(),
        "{doc_path} cites tests that do not exist: {missing:#?}"
    );
}

#[test]
fn design_doc_names_only_tests_that_exist() {
    check("docs/design.md");
}

#[test]
fn fencing_doc_names_only_tests_that_exist() {
    if Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/fencing.md")
        .exists()
    {
        check("docs/fencing.md");
    }
}

#[test]
fn every_doc_names_only_tests_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut docs = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/ exists") {
        let path = entry.expect("a docs/ entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(path);
        }
    }
    for path in docs {
        let doc = std::fs::read_to_string(&path).unwrap_or_default();
        check_citations(&path.display().to_string(), &doc);
    }
}

#[test]
fn the_citation_parser_finds_references() {
    let cited = cited_tests("Verified by: `tests/all/x.rs::a_test`, and `not::this`.");
    assert_eq!(
        cited,
        vec![("tests/all/x.rs".to_owned(), "a_test".to_owned())]
    );
}

/// The Rust files of the workspace's own crates (not `target/`).
fn rust_files() -> Vec<std::path::PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut out = Vec::new();
    let mut dirs: Vec<_> = ["host", "guest-sdk", "tests", "benches", "examples", "fuzz"]
        .iter()
        .map(|d| root.join(d))
        .collect();
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if path.is_dir() {
                if name != "target" && name != ".guest-toolchains" && name != "node_modules" {
                    dirs.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// House style (issue 18 item 8): every `allow` says why, in its `reason`.
#[test]
fn every_allow_gives_its_reason() {
    let mut bare = Vec::new();
    for path in rust_files() {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for (at, _) in text.match_indices("allow(") {
            let before = &text[..at];
            if !(before.ends_with("#[") || before.ends_with("#![")) {
                continue;
            }
            let attribute = &text[at..text[at..].find(")]").map_or(text.len(), |end| at + end)];
            if !attribute.contains("reason") {
                let line = before.matches('\n').count() + 1;
                bare.push(format!("{}:{line}: #[{attribute})]", path.display()));
            }
        }
    }
    assert!(
        bare.is_empty(),
        "allow attributes without a reason = \"…\":\n{}",
        bare.join("\n")
    );
}

/// House style: every module of the crates' sources starts with a `//!`
/// header saying what it owns.
#[test]
fn every_module_has_a_header() {
    let missing: Vec<_> = rust_files()
        .into_iter()
        .filter(|p| {
            let s = p.to_string_lossy();
            s.contains("/src/") && !s.contains("/tests/guests/") && !s.contains("/examples/")
        })
        .filter(|p| {
            !std::fs::read_to_string(p)
                .unwrap_or_default()
                .trim_start()
                .starts_with("//!")
        })
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        missing.is_empty(),
        "modules without a //! header: {missing:#?}"
    );
}

/// The `(METHOD, path)` pairs the router registers, read from the sources
/// that call `.route(...)` ([`fief::http::router_with`] and the route
/// functions it merges): each `.route("PATH", ...)` with the methods of its
/// method router (`get(h).put(h)`, `axum::routing::delete(h)`).
fn routes_in(source: &str) -> Vec<(String, String)> {
    const METHODS: [&str; 5] = ["get", "post", "put", "delete", "patch"];
    let mut out = Vec::new();
    for (at, _) in source.match_indices(".route(") {
        let rest = &source[at + ".route(".len()..];
        let Some(path) = rest.split('"').nth(1) else {
            continue;
        };
        // The method router: up to the `)` closing `.route(`.
        let mut depth = 1;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                depth == 0
            })
            .map_or(rest.len(), |(i, _)| i);
        let router = &rest[..end];
        for method in METHODS {
            let called = router.match_indices(&format!("{method}(")).any(|(i, _)| {
                !router[..i]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            });
            if called {
                out.push((method.to_uppercase(), path.to_owned()));
            }
        }
    }
    out
}

#[test]
fn the_route_parser_finds_methods() {
    let source = r#"Router::new()
        .route("/a/{x}", put(deploy).get(crate::m::get_one).delete(crate::m::undeploy))
        .route("/b", axum::routing::delete(kill))
        .route("/c", get(cache_delete))"#;
    assert_eq!(
        routes_in(source),
        [
            ("GET", "/a/{x}"),
            ("PUT", "/a/{x}"),
            ("DELETE", "/a/{x}"),
            ("DELETE", "/b"),
            ("GET", "/c"),
        ]
        .map(|(m, p)| (m.to_owned(), p.to_owned()))
    );
}

/// Issue 22 item 1: the OpenAPI document (`GET /v1/openapi.json`,
/// `host/src/openapi.rs`) has every route the router serves, and nothing
/// else; a route added without its document fails here, named.
#[test]
fn every_route_is_in_the_openapi_document() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut served = Vec::new();
    for file in [
        "host/src/http.rs",
        "host/src/dashboard.rs",
        "host/src/probes.rs",
    ] {
        let source = std::fs::read_to_string(root.join(file)).expect("a router source");
        served.extend(routes_in(&source));
    }
    // Every file of the host that registers routes is one of those above.
    for path in rust_files() {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let name = path.to_string_lossy();
        if name.contains("/host/src/")
            && !["http.rs", "dashboard.rs", "probes.rs"]
                .iter()
                .any(|f| name.ends_with(f))
        {
            assert!(
                routes_in(&text).is_empty(),
                "{name} registers routes: add it to this test's list"
            );
        }
    }
    assert!(
        served.len() > 20,
        "the route parser found too few: {served:?}"
    );
    let documented = fief::openapi::operations();
    let missing: Vec<_> = served
        .iter()
        .filter(|r| !documented.contains(r))
        .map(|(m, p)| format!("{m} {p}"))
        .collect();
    assert!(
        missing.is_empty(),
        "routes missing from the OpenAPI document (host/src/openapi.rs, operations_table): {missing:#?}"
    );
    let extra: Vec<_> = documented
        .iter()
        .filter(|r| !served.contains(r))
        .map(|(m, p)| format!("{m} {p}"))
        .collect();
    assert!(
        extra.is_empty(),
        "the OpenAPI document lists operations the router does not serve: {extra:#?}"
    );
}
