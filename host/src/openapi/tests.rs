//! Unit tests of the OpenAPI document ([`super`]): the error catalogue
//! against every [`crate::Error`] variant, the document's shape and
//! references, and the module options' schema.

use super::errors::ERRORS;
use super::operations::operations_table;
use super::*;
use crate::Error;

/// One value of every [`Error`] variant. The `match` below has no
/// wildcard: a new variant does not compile until it is added here.
fn every_error() -> Vec<Error> {
    use fief_core::PartitionId;
    let s = String::new;
    let all = vec![
        Error::UnknownModule(s()),
        Error::InvalidKey(s()),
        Error::InvalidModuleName {
            name: s(),
            why: s(),
        },
        Error::MessageTooLarge { size: 0, limit: 0 },
        Error::ReplyTooLarge { size: 0, limit: 0 },
        Error::HandoffTooLarge { size: 0, limit: 0 },
        Error::InvalidModule(s()),
        Error::InvalidOptions(s()),
        Error::Fenced,
        Error::FencedWhileLeaving,
        Error::Unowned(PartitionId(0)),
        Error::OwnerUnreachable {
            owner: s(),
            why: s(),
        },
        Error::AnswerLost { owner: s() },
        Error::AlreadyLeaving,
        Error::NotOwner { owner: s() },
        Error::Overloaded {
            module: s(),
            key: s(),
            depth: 0,
        },
        Error::HostMemory {
            module: s(),
            key: s(),
            refusal: crate::Refusal {
                scope: s(),
                used: 0,
                limit: 0,
                asked: 0,
                option: "",
            },
        },
        Error::CompileBusy { tenant: s() },
        Error::TooManyKeys {
            module: s(),
            limit: 0,
        },
        Error::PoolFull {
            module: s(),
            detail: s(),
        },
        Error::InitRefused(s()),
        Error::Rejected(s()),
        Error::KeyDied(s()),
        Error::Timeout(std::time::Duration::ZERO),
        Error::Deadlock,
        Error::ShuttingDown,
        Error::Config(s()),
        Error::MethodNotAllowed(s()),
        Error::NoSuchEndpoint(s()),
        Error::UriTooLong { limit: 0 },
        Error::HeadersTooLarge {
            limit: 0,
            fields: 0,
        },
        Error::TooManyConnections { limit: 0 },
        Error::TooManySockets {
            scope: s(),
            limit: 0,
            option: "",
        },
        Error::NotConnectable(s()),
        Error::UpgradeRequired(s()),
        Error::VersionConflict { current: None },
        Error::CacheEntryTooLarge { size: 0, limit: 0 },
        Error::CacheFull { size: 0, limit: 0 },
        Error::Unauthorized(s()),
        Error::Forbidden(s()),
        Error::UnknownModuleVersion {
            module: s(),
            version: 0,
            stored: s(),
        },
        Error::ModuleStore(s()),
        Error::ArbiterUnavailable(s()),
        Error::StorageUnavailable(s()),
        Error::Internal(s()),
    ];
    for e in &all {
        match e {
            Error::UnknownModule(_)
            | Error::InvalidKey(_)
            | Error::InvalidModuleName { .. }
            | Error::MessageTooLarge { .. }
            | Error::ReplyTooLarge { .. }
            | Error::HandoffTooLarge { .. }
            | Error::InvalidModule(_)
            | Error::InvalidOptions(_)
            | Error::Fenced
            | Error::FencedWhileLeaving
            | Error::Unowned(_)
            | Error::OwnerUnreachable { .. }
            | Error::AnswerLost { .. }
            | Error::AlreadyLeaving
            | Error::NotOwner { .. }
            // Passes an owner's error through: its code is one of these.
            | Error::Remote { .. }
            | Error::Overloaded { .. }
            | Error::HostMemory { .. }
            | Error::CompileBusy { .. }
            | Error::TooManyKeys { .. }
            | Error::PoolFull { .. }
            | Error::InitRefused(_)
            | Error::Rejected(_)
            | Error::KeyDied(_)
            | Error::Timeout(_)
            | Error::Deadlock
            | Error::ShuttingDown
            | Error::Config(_)
            | Error::MethodNotAllowed(_)
            | Error::NoSuchEndpoint(_)
            | Error::UriTooLong { .. }
            | Error::HeadersTooLarge { .. }
            | Error::TooManyConnections { .. }
            | Error::TooManySockets { .. }
            | Error::NotConnectable(_)
            | Error::UpgradeRequired(_)
            | Error::VersionConflict { .. }
            | Error::CacheEntryTooLarge { .. }
            | Error::CacheFull { .. }
            | Error::Unauthorized(_)
            | Error::Forbidden(_)
            | Error::UnknownModuleVersion { .. }
            | Error::ModuleStore(_)
            | Error::ArbiterUnavailable(_)
            | Error::StorageUnavailable(_)
            | Error::Internal(_) => {}
        }
    }
    all
}

#[test]
fn every_error_code_and_status_is_in_the_catalogue() {
    let mut missing = Vec::new();
    for e in every_error() {
        let (code, status) = (e.code(), e.http_status());
        if !ERRORS.iter().any(|x| x.1 == code && x.2 == status) {
            missing.push(format!("{code} {status} ({e:?})"));
        }
    }
    assert!(
        missing.is_empty(),
        "errors missing from openapi::ERRORS: {missing:#?}"
    );
    // ... and the catalogue names nothing the API never answers.
    let answered: Vec<(String, u16)> = every_error()
        .iter()
        .map(|e| (e.code().to_owned(), e.http_status()))
        .chain([("not_found".to_owned(), 404)])
        .collect();
    for (name, code, status, _) in ERRORS {
        assert!(
            answered.iter().any(|(c, s)| c == code && s == status),
            "ERRORS lists {name} ({code} {status}), which no error answers"
        );
    }
}

#[test]
fn the_document_is_openapi_3_1_and_every_ref_resolves() {
    let doc = document();
    assert_eq!(doc["openapi"], "3.1.0");
    let parsed: Result<utoipa::openapi::OpenApi, _> = serde_json::from_value(doc.clone());
    if let Err(e) = parsed {
        panic!("not an OpenAPI document: {e}");
    }
    fn refs(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(r)) = map.get("$ref") {
                    out.push(r.clone());
                }
                map.values().for_each(|v| refs(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(doc, &mut all);
    assert!(!all.is_empty());
    for r in all {
        let name = r.trim_start_matches("#/components/schemas/");
        assert!(
            doc["components"]["schemas"].get(name).is_some(),
            "{r} does not resolve"
        );
    }
    // Every operation has a unique id and a success answer.
    let mut ids = std::collections::BTreeSet::new();
    for op in operations_table() {
        assert!(ids.insert(op.id), "operationId {} twice", op.id);
        assert!(!op.answers.is_empty(), "{} has no answer", op.id);
        for name in &op.errors {
            assert!(
                ERRORS.iter().any(|e| e.0 == *name),
                "{}: unknown error {name}",
                op.id
            );
        }
    }
}

#[test]
fn module_options_schema_names_every_option() {
    let doc = document();
    let options = &doc["components"]["schemas"]["ModuleOptions"]["properties"];
    for option in crate::config::option_table::OPTIONS {
        assert!(
            options.get(option.name).is_some(),
            "{} missing",
            option.name
        );
    }
}

#[test]
fn hand_written_schemas_are_not_the_empty_fallback() {
    let schemas = &document()["components"]["schemas"];
    assert_eq!(
        schemas["StoredValue"]["oneOf"].as_array().map(Vec::len),
        Some(2),
        "{}",
        schemas["StoredValue"]
    );
    assert!(schemas["ModuleOptions"]["properties"]["on_fence"]["enum"].is_array());
}
