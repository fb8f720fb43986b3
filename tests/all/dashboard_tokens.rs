//! The dashboard under API tokens, with its plots, in a real browser
//! (issue 22 item 5): a 3-node cluster of real `fief` processes on
//! PostgreSQL started with a tokens file. The page asks for a token; a
//! wrong one shows the refusal; the admin's shows the four plots (calls/s,
//! p99 latency, live keys, fences) with one SVG line per node, each node's
//! samples fetched over the peer link; a tenant's shows only its own
//! module and no plots. Screenshots go to `target/dashboard-screenshots/`
//! (`tokens-*.png`). Headless Chromium as in `dashboard.rs`.

use std::time::{Duration, Instant};

use fantoccini::{Client, Locator};
use fief_tests::guests;
use fief_tests::multiprocess::{
    ClusterNode, FAST_TIMINGS, NodeSpec, PG_ADDR, arbiter_url, drop_namespace, test_database,
    unique_namespace,
};

use crate::browser::Driver;
use crate::dashboard::screenshot;
use crate::processes::{SERIAL, wait_settled};

const ADMIN: &str = "admin-token-0123456789abcdef";
const ACME: &str = "acme-token-0123456789abcdef";
const GLOBEX: &str = "globex-token-0123456789abcdef";

/// How long the page may take to show what the test waits for.
const PAGE_LIMIT: Duration = Duration::from_secs(60);

/// Run `script` in the page until it returns `true` (at most
/// [`PAGE_LIMIT`]), failing with the page's text if it never does.
async fn wait_until(client: &Client, what: &str, script: &str) {
    let deadline = Instant::now() + PAGE_LIMIT;
    loop {
        let done = client
            .execute(script, vec![])
            .await
            .expect("reading the page");
        if done == serde_json::Value::Bool(true) {
            return;
        }
        if Instant::now() >= deadline {
            let body = client
                .execute("return document.body.innerText;", vec![])
                .await
                .unwrap_or_default();
            panic!("the dashboard did not show {what} within {PAGE_LIMIT:?}; it shows {body}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn enter_token(client: &Client, token: &str) {
    let input = client
        .find(Locator::Css("#token"))
        .await
        .expect("the token field");
    input.send_keys(token).await.expect("typing the token");
    client
        .find(Locator::Css("#token-submit"))
        .await
        .expect("the submit button")
        .click()
        .await
        .expect("submitting the token");
}

async fn deploy(node: &ClusterNode, token: &str, name: &str) {
    let response = reqwest::Client::new()
        .put(format!("{}/v1/modules/{name}", node.url))
        .bearer_auth(token)
        .body(guests::bytes(guests::COUNTER))
        .send()
        .await
        .expect("deploying");
    assert_eq!(response.status(), 200, "{:?}", response.text().await);
}

/// Issue 22 item 5 ("with tokens configured it asks for one (admin sees
/// the cluster; a tenant sees only its modules and keys) … it plots the
/// last minutes of calls/s, p99 latency, live keys and fences per node;
/// browser-tested with screenshots").
#[tokio::test]
async fn the_dashboard_asks_for_a_token_and_plots_every_node() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("dashtokens");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        format!(
            "[admin]\ntokens = [\"{ADMIN}\"]\n[tenants.acme]\ntokens = [\"{ACME}\"]\n\
             [tenants.globex]\ntokens = [\"{GLOBEX}\"]\n"
        ),
    )
    .expect("writing the tokens file");
    let mut nodes = Vec::new();
    for id in ["n1", "n2", "n3"] {
        let mut extra_args: Vec<String> = FAST_TIMINGS.iter().map(|s| (*s).to_owned()).collect();
        extra_args.push("--tokens".to_owned());
        extra_args.push(tokens.to_string_lossy().into_owned());
        let spec = NodeSpec {
            node_id: id.to_owned(),
            namespace: namespace.clone(),
            arbiter: arbiter_url(PG_ADDR),
            deploy: vec![("counter".to_owned(), guests::COUNTER.to_owned())],
            extra_args,
        };
        let mut node = ClusterNode::spawn(&spec).await;
        node.use_token(ADMIN);
        node.wait_current(Duration::from_secs(30)).await;
        nodes.push(node);
    }
    wait_settled(&nodes).await;
    deploy(&nodes[0], ACME, "tally").await;
    deploy(&nodes[0], GLOBEX, "ledger").await;
    // Calls through every node, so every node serves some and has keys.
    for i in 0..24 {
        let _ = nodes[i % 3].call("counter", &format!("k{i}"), "incr").await;
    }
    let acme = reqwest::Client::new();
    for key in ["alice", "bob"] {
        let response = acme
            .post(format!("{}/v1/keys/tally/{key}/call", nodes[0].url))
            .bearer_auth(ACME)
            .body("incr")
            .send()
            .await
            .expect("acme's call");
        assert_eq!(response.status(), 200);
    }

    // Calls go on while the page is watched, so the plots move.
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let load = tokio::spawn(async move {
        let client = reqwest::Client::new();
        for i in 0u64.. {
            let url = format!("{}/v1/keys/counter/k{}/call", urls[i as usize % 3], i % 24);
            let _ = client
                .post(url)
                .bearer_auth(ADMIN)
                .body("incr")
                .send()
                .await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });

    let driver = Driver::start("dashboard_tokens");
    let client = driver.session_sized(1280, 1300).await;
    client
        .goto(&format!("{}/", nodes[0].url))
        .await
        .expect("loading the dashboard");
    wait_until(
        &client,
        "the token form",
        r##"return !document.getElementById("login").hidden && document.getElementById("main").hidden;"##,
    )
    .await;
    let asks = screenshot(&client, "tokens-1-asks-for-a-token.png").await;

    enter_token(&client, "not-a-token-0123456789").await;
    wait_until(
        &client,
        "the wrong token refused",
        r##"return document.getElementById("login-error").textContent.includes("refused")
             && document.getElementById("main").hidden;"##,
    )
    .await;
    let refused = screenshot(&client, "tokens-2-wrong-token.png").await;

    // The admin: four plots, each with one line per node (the two peers'
    // samples came over the peer link), and the calls made.
    enter_token(&client, ADMIN).await;
    let ids: Vec<String> = nodes.iter().map(|n| n.node_id.clone()).collect();
    let every_node_plotted = format!(
        r##"const ids = {ids:?};
        const plots = document.querySelectorAll("#plots .plot");
        if (plots.length !== 4 || document.getElementById("main").hidden) return false;
        for (const plot of plots) {{
          const lines = [...plot.querySelectorAll("svg path.line")].map((p) => p.dataset.node);
          // p99 has no line for a node that served no calls (no latency).
          if (plot.dataset.metric === "p99_ms") {{
            if (lines.length === 0 || !lines.every((id) => ids.includes(id))) return false;
          }} else if (lines.length !== ids.length || !ids.every((id) => lines.includes(id))) return false;
          if (plot.dataset.metric === "live_keys" && ![...plot.querySelectorAll("svg path.line")]
              .every((p) => p.getAttribute("d").includes("L"))) return false;
        }}
        const calls = document.querySelector('#plots .plot[data-metric="calls"] text.max').textContent;
        const keys = document.querySelector('#plots .plot[data-metric="live_keys"] text.max').textContent;
        return calls !== "0" && keys !== "0"
          && document.querySelectorAll("#plots-legend .nodata").length === 0
          && document.getElementById("who").textContent === "as admin";"##
    );
    wait_until(
        &client,
        "one line per node in every plot",
        &every_node_plotted,
    )
    .await;
    let admin = screenshot(&client, "tokens-3-admin-plots.png").await;
    let modules: serde_json::Value = client
        .execute(
            r##"return [...document.querySelectorAll("#modules tbody tr")].map((r) => r.dataset.module).sort();"##,
            vec![],
        )
        .await
        .expect("reading the modules");
    assert_eq!(
        modules,
        serde_json::json!(["acme/tally", "counter", "globex/ledger"]),
        "the admin sees every module"
    );

    // A tenant: only its own module, no plots, no other tenant's name.
    client
        .find(Locator::Css("#sign-out"))
        .await
        .expect("the sign-out button")
        .click()
        .await
        .expect("forgetting the token");
    wait_until(
        &client,
        "the token form again",
        r##"return !document.getElementById("login").hidden;"##,
    )
    .await;
    enter_token(&client, ACME).await;
    wait_until(
        &client,
        "acme's own module only",
        r##"const rows = [...document.querySelectorAll("#modules tbody tr")].map((r) => r.dataset.module);
        const text = document.body.innerText;
        return rows.length === 1 && rows[0] === "tally"
          && document.getElementById("plots-section").hidden
          && document.getElementById("who").textContent === "as tenant:acme"
          && !text.includes("ledger") && !text.includes("globex") && !text.includes("counter");"##,
    )
    .await;
    let html: serde_json::Value = client
        .execute("return document.documentElement.outerHTML;", vec![])
        .await
        .expect("reading the page");
    let html = html.as_str().unwrap_or_default();
    assert!(
        !html.contains("ledger") && !html.contains("globex"),
        "another tenant's module is in acme's page"
    );
    let tenant = screenshot(&client, "tokens-4-tenant.png").await;
    eprintln!(
        "dashboard screenshots: {}, {}, {} and {}",
        asks.display(),
        refused.display(),
        admin.display(),
        tenant.display()
    );
    client.close().await.expect("closing the browser session");
    load.abort();
    drop(nodes);
    drop_namespace(&db, &namespace).await;
}
