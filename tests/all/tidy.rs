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
