//! Every module option has a node ceiling (issue "Hostile tenants cannot
//! hurt the node or each other", finding 2: `cpu_limit=1000000000h`,
//! `mailbox_depth=1e8`, `max_timers_per_key=4294967295` and
//! `idle_timeout=1e15h` were accepted, so a tenant without caps could
//! deploy a key that is never killed). A deploy over a ceiling is refused
//! with a message naming the option, the value and the ceiling, and nothing
//! is stored; the operator sets the ceilings (`NodeConfig::module_ceilings`,
//! `[module_ceilings]` in the config file, `--module-ceiling NAME=VALUE`).
//! A version stored before a ceiling was lowered is loaded with each option
//! over it lowered to the ceiling, logged and counted (docs/operations.md,
//! "Module ceilings").

use std::sync::Arc;
use std::time::Duration;

use fief::arbiter::{Arbiter, LocalArbiter};
use fief::core::PartitionCount;
use fief::{Error, Instance, ModuleCeilings, ModuleOptions, NodeConfig};
use fief_tests::{HttpServer, call_text, guests, test_config};

async fn refused(node: &Instance, options: ModuleOptions) -> String {
    match node
        .deploy("counter", guests::bytes(guests::COUNTER), options)
        .await
    {
        Err(Error::InvalidOptions(why)) => why,
        other => panic!("expected a refusal naming the ceiling, got {other:?}"),
    }
}

#[tokio::test]
async fn options_over_the_default_ceilings_are_refused_by_name() {
    // The default ceilings (test_config raises cpu_limit's for other tests).
    let config = NodeConfig {
        module_ceilings: ModuleCeilings::default(),
        ..test_config()
    };
    let node = Instance::start_embedded(config).await.unwrap();
    let cases = [
        (
            ModuleOptions {
                cpu_limit: Duration::from_secs(1_000_000_000 * 3600),
                ..ModuleOptions::default()
            },
            "cpu_limit (1000000000h) is over this node's ceiling (10s)",
        ),
        (
            ModuleOptions {
                mailbox_depth: 100_000_000,
                ..ModuleOptions::default()
            },
            "mailbox_depth (100000000) is over this node's ceiling (65536)",
        ),
        (
            ModuleOptions {
                max_timers_per_key: u32::MAX,
                ..ModuleOptions::default()
            },
            "max_timers_per_key (4294967295) is over this node's ceiling (65536)",
        ),
        (
            ModuleOptions {
                idle_timeout: Duration::from_secs(1_000_000_000_000_000 * 3600),
                ..ModuleOptions::default()
            },
            "idle_timeout",
        ),
        (
            ModuleOptions {
                max_subscriptions_per_key: 1_000_000,
                ..ModuleOptions::default()
            },
            "max_subscriptions_per_key (1000000) is over this node's ceiling (4096)",
        ),
        (
            ModuleOptions {
                max_publishes_per_second: u32::MAX,
                ..ModuleOptions::default()
            },
            "max_publishes_per_second",
        ),
        (
            ModuleOptions {
                max_live_keys: u32::MAX,
                ..ModuleOptions::default()
            },
            "max_live_keys",
        ),
    ];
    for (options, says) in cases {
        let why = refused(&node, options).await;
        assert!(why.contains(says), "{why}");
        assert!(
            why.contains("--module-ceiling"),
            "it says how to raise it: {why}"
        );
    }
    assert!(node.status().modules.is_empty(), "nothing was deployed");
    // At the ceiling is fine.
    node.deploy(
        "counter",
        guests::bytes(guests::COUNTER),
        ModuleOptions {
            cpu_limit: Duration::from_secs(10),
            ..ModuleOptions::default()
        },
    )
    .await
    .expect("a cpu_limit at the ceiling deploys");
    node.shutdown().await;
}

#[tokio::test]
async fn an_operator_lowers_a_ceiling_and_deploys_are_held_to_it() {
    let mut ceilings = ModuleCeilings::default();
    ceilings.set("cpu_limit", "1s").unwrap();
    ceilings.set("mailbox_depth", "2048").unwrap();
    let node = Instance::start_embedded(NodeConfig {
        module_ceilings: ceilings,
        ..test_config()
    })
    .await
    .unwrap();
    let why = refused(
        &node,
        ModuleOptions {
            cpu_limit: Duration::from_secs(2),
            ..ModuleOptions::default()
        },
    )
    .await;
    assert!(
        why.contains("cpu_limit (2s) is over this node's ceiling (1s)"),
        "{why}"
    );
    let why = refused(
        &node,
        ModuleOptions {
            mailbox_depth: 4096,
            ..ModuleOptions::default()
        },
    )
    .await;
    assert!(why.contains("(2048)"), "{why}");
    node.deploy(
        "counter",
        guests::bytes(guests::COUNTER),
        ModuleOptions::default(),
    )
    .await
    .expect("the defaults fit");
    node.shutdown().await;
}

#[test]
fn ceilings_are_named_and_parsed_with_clear_errors() {
    let mut c = ModuleCeilings::default();
    let unknown = c.set("cpu", "1s").unwrap_err().to_string();
    assert!(
        unknown.contains("unknown module ceiling \"cpu\""),
        "{unknown}"
    );
    assert!(
        unknown.contains("cpu_limit"),
        "it lists the names: {unknown}"
    );
    let bad = c.set("mailbox_depth", "1e8").unwrap_err().to_string();
    assert!(bad.contains("mailbox_depth"), "{bad}");
    // A ceiling the defaults do not fit stops the node at start, saying so.
    let config = NodeConfig {
        module_ceilings: ModuleCeilings {
            cpu_limit: Duration::from_millis(50),
            ..ModuleCeilings::default()
        },
        ..test_config()
    };
    let why = config.validate().unwrap_err().to_string();
    assert!(
        why.contains("cpu_limit (100ms) is over this node's ceiling (50ms)"),
        "{why}"
    );
}

/// Finding 2, on load: a version stored under higher ceilings is loaded by a
/// node restarted with lower ones, with each option over a ceiling lowered
/// to it (the others as stored), counted in the metrics; the store keeps
/// what was deployed, and the key runs.
#[tokio::test]
async fn a_stored_version_over_a_lowered_ceiling_loads_with_the_option_lowered() {
    let arbiter: Arc<dyn Arbiter> = Arc::new(LocalArbiter::new(
        Arc::new(fief::TokioClock::new()),
        PartitionCount::new(test_config().partitions).unwrap(),
    ));
    let stored = ModuleOptions {
        cpu_limit: Duration::from_secs(5),
        mailbox_depth: 4096,
        max_timers_per_key: 100,
        ..ModuleOptions::default()
    };
    let generous = Instance::builder(NodeConfig {
        module_ceilings: ModuleCeilings::default(),
        ..test_config()
    })
    .arbiter(arbiter.clone())
    .start()
    .await
    .unwrap();
    generous
        .deploy("counter", guests::bytes(guests::COUNTER), stored.clone())
        .await
        .expect("within the default ceilings");
    generous.leave(Duration::from_secs(10)).await.unwrap();
    generous.shutdown().await;

    let mut lower = ModuleCeilings::default();
    lower.set("cpu_limit", "1s").unwrap();
    lower.set("mailbox_depth", "1024").unwrap();
    let strict = Arc::new(
        Instance::builder(NodeConfig {
            module_ceilings: lower,
            ..test_config()
        })
        .arbiter(arbiter.clone())
        .start()
        .await
        .expect("a stored version over a ceiling does not stop the start"),
    );
    let modules = strict.status().modules;
    assert_eq!(modules.len(), 1, "loaded at start: {modules:?}");
    let running = &modules[0].options;
    assert_eq!(running.cpu_limit, Duration::from_secs(1), "lowered");
    assert_eq!(running.mailbox_depth, 1024, "lowered");
    assert_eq!(running.max_timers_per_key, 100, "within its ceiling: kept");
    assert_eq!(call_text(&strict, "counter", "k", "incr").await, "1");
    let listing = strict.modules().await.unwrap();
    assert_eq!(
        listing[0].versions[0].options, stored,
        "the store keeps what was deployed"
    );
    let server = HttpServer::start(strict.clone()).await;
    let metrics = reqwest::get(server.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for option in ["cpu_limit", "mailbox_depth"] {
        let series = format!("fief_module_options_lowered_total{{option=\"{option}\"}} 1");
        assert!(metrics.contains(&series), "{series} in:\n{metrics}");
    }
    assert!(!metrics.contains("option=\"max_timers_per_key\""));
}

/// `fief deploy --help` lists every module option with its meaning, default
/// and bound, and `fief node --help` every ceiling with its default, both
/// from the table the parsing and the ceiling checks read
/// (`fief::config::option_table`): an option added there is listed, and the
/// hand-written list it replaced (missing the storage, alarm and connection
/// ceilings) cannot drift again.
#[test]
fn the_cli_help_lists_every_module_option_with_its_default_and_ceiling() {
    use fief::config::option_table::{OPTIONS, options_help};
    let help = |args: &[&str]| {
        let out = fief_tests::fief_cli(args);
        assert!(out.status.success(), "fief {args:?} failed");
        String::from_utf8(out.stdout).expect("UTF-8 help")
    };
    let deploy = help(&["deploy", "--help"]);
    assert!(deploy.contains(&options_help()), "{deploy}");
    let defaults = ModuleOptions::default();
    let ceilings = ModuleCeilings::default();
    for o in OPTIONS {
        assert!(
            deploy.contains(&format!(
                "default {}; {}",
                o.value(&defaults),
                o.bound_text(&ceilings)
            )),
            "{} is not listed with its default and bound:\n{deploy}",
            o.name
        );
    }
    assert!(deploy.contains("cpu_limit\n      CPU time one callback may use before the key is killed\n      default 100ms; node ceiling 10s"));
    let node = help(&["node", "--help"]);
    for o in OPTIONS.iter().filter(|o| o.ceiling().is_some()) {
        assert!(
            node.contains(&format!("  {} (default ", o.name)),
            "ceiling {} is not listed:\n{node}",
            o.name
        );
    }
    assert!(
        node.contains("max_storage_bytes_per_key (default 1.0 GiB)"),
        "{node}"
    );
}
