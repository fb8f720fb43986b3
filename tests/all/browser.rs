//! Headless Chromium for the browser tests (`dashboard.rs`,
//! `chat_browser.rs`): Debian's `chromium` driven over WebDriver by
//! `chromedriver` (Debian's `chromium-driver`) with the `fantoccini` client.
//! A test that needs it fails, rather than skips, without them on the `PATH`
//! (`./scripts/test.sh` installs both, through `scripts/install-test-deps.sh`).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder};
use fief_tests::free_port;

/// `chromedriver` on a free port, killed when dropped.
pub(crate) struct Driver {
    child: Child,
    url: String,
}

impl Driver {
    /// Start chromedriver; `test` names the test that needs it, for the
    /// message if it cannot start.
    pub(crate) fn start(test: &str) -> Driver {
        let port = free_port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start chromedriver ({e}): the {test} test needs Debian's \
                     `chromium` and `chromium-driver` packages (apt-get install -y chromium \
                     chromium-driver; ./scripts/test.sh installs them)"
                )
            });
        Driver {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    /// A headless Chromium session, once chromedriver answers (at most 30 s).
    /// A headless Chromium session of `width` × `height` pixels.
    pub(crate) async fn session_sized(&self, width: u32, height: u32) -> Client {
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".to_owned(),
            serde_json::json!({
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    &format!("--window-size={width},{height}"),
                ]
            }),
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(capabilities.clone())
                .connect(&self.url)
                .await
            {
                Ok(client) => return client,
                Err(e) => assert!(
                    Instant::now() < deadline,
                    "no Chromium session from chromedriver within 30 s: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
