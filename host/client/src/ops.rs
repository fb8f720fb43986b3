//! One method per API operation, each with a doctested example. Every
//! request goes through `Client::send`, so refusals are retried alike. Must
//! not hold HTTP plumbing (that is `lib.rs`).

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::{
    CacheEntry, CacheExpect, Client, Deployed, Error, LeaveReport, StoredAlarm, StoredEntry,
};

/// Upload chunk size: the unit of [`Client::deploy_with_progress`]'s
/// reports.
const CHUNK: usize = 256 * 1024;

async fn json<T: DeserializeOwned>(response: reqwest::Response) -> Result<T, Error> {
    let bytes = response
        .bytes()
        .await
        .map_err(|e| Error::Decode(e.to_string()))?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Decode(e.to_string()))
}

impl Client {
    /// `GET` `path` (e.g. `/v1/status`) as JSON: for operations without a
    /// method of their own.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let ready = node.get_json("/v1/keys").await?;
    /// # Ok(()) }
    /// ```
    pub async fn get_json(&self, path: &str) -> Result<serde_json::Value, Error> {
        let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let url = self.url(&segments);
        json(self.send(|http| http.get(url.clone())).await?).await
    }

    /// Deploy `wasm` as module `name` with `options` (`("memory_limit",
    /// "32MiB")`, ...; `fief deploy --help` lists them): stored, compiled
    /// and loaded by every node.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let wasm = std::fs::read("counter.wasm").unwrap();
    /// let deployed = node.deploy("counter", wasm, &[("cpu_limit", "200ms")]).await?;
    /// println!("version {}", deployed.version);
    /// # Ok(()) }
    /// ```
    pub async fn deploy(
        &self,
        name: &str,
        wasm: impl Into<bytes::Bytes>,
        options: &[(&str, &str)],
    ) -> Result<Deployed, Error> {
        self.deploy_with_progress(name, wasm, options, |_, _| {})
            .await
    }

    /// [`deploy`](Self::deploy), calling `sent(bytes_sent, total)` as the
    /// upload goes.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let wasm = std::fs::read("counter.wasm").unwrap();
    /// node.deploy_with_progress("counter", wasm, &[], |sent, total| {
    ///     eprintln!("{sent} of {total} bytes");
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub async fn deploy_with_progress(
        &self,
        name: &str,
        wasm: impl Into<bytes::Bytes>,
        options: &[(&str, &str)],
        sent: impl Fn(u64, u64) + Send + Sync + 'static,
    ) -> Result<Deployed, Error> {
        let wasm: bytes::Bytes = wasm.into();
        let total = wasm.len() as u64;
        let url = self.url(&["v1", "modules", name]);
        let sent = Arc::new(sent);
        let response = self
            .send(|http| {
                let sent = sent.clone();
                let mut so_far = 0u64;
                let chunks: Vec<bytes::Bytes> = (0..wasm.len())
                    .step_by(CHUNK)
                    .map(|at| wasm.slice(at..(at + CHUNK).min(wasm.len())))
                    .collect();
                let stream = futures_util::stream::iter(chunks.into_iter().map(move |chunk| {
                    so_far += chunk.len() as u64;
                    sent(so_far, total);
                    Ok::<_, std::io::Error>(chunk)
                }));
                http.put(url.clone())
                    .query(options)
                    .header(reqwest::header::CONTENT_LENGTH, total)
                    .body(reqwest::Body::wrap_stream(stream))
            })
            .await?;
        json(response).await
    }

    /// The cluster's modules: versions, the current one, where loaded.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// for module in node.modules().await?.as_array().into_iter().flatten() {
    ///     println!("{}", module["name"]);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn modules(&self) -> Result<serde_json::Value, Error> {
        self.get_json("/v1/modules").await
    }

    /// One module: every stored version with its options and deployer.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let counter = node.module("counter").await?;
    /// println!("current version {}", counter["current"]);
    /// # Ok(()) }
    /// ```
    pub async fn module(&self, name: &str) -> Result<serde_json::Value, Error> {
        let url = self.url(&["v1", "modules", name]);
        json(self.send(|http| http.get(url.clone())).await?).await
    }

    /// Make stored `version` of module `name` current again.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// node.rollback("counter", 2).await?;
    /// # Ok(()) }
    /// ```
    pub async fn rollback(&self, name: &str, version: u64) -> Result<serde_json::Value, Error> {
        let url = self.url(&["v1", "modules", name, "rollback"]);
        let version = version.to_string();
        json(
            self.send(|http| http.post(url.clone()).query(&[("version", &version)]))
                .await?,
        )
        .await
    }

    /// Remove module `name` from the cluster (its keys stop).
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// node.undeploy("counter").await?;
    /// # Ok(()) }
    /// ```
    pub async fn undeploy(&self, name: &str) -> Result<serde_json::Value, Error> {
        let url = self.url(&["v1", "modules", name]);
        json(self.send(|http| http.delete(url.clone())).await?).await
    }

    /// Send `message` to key `key` of `module` and wait for its reply.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let reply = node.call("counter", "alice", "incr").await?;
    /// assert!(!reply.is_empty());
    /// # Ok(()) }
    /// ```
    pub async fn call(
        &self,
        module: &str,
        key: &str,
        message: impl Into<bytes::Bytes>,
    ) -> Result<Vec<u8>, Error> {
        let url = self.url(&["v1", "keys", module, key, "call"]);
        let message: bytes::Bytes = message.into();
        let response = self
            .send(|http| http.post(url.clone()).body(message.clone()))
            .await?;
        let bytes = response
            .bytes()
            .await
            .map_err(|e| Error::Decode(e.to_string()))?;
        Ok(bytes.to_vec())
    }

    /// Queue `message` for key `key` of `module` without waiting for it to
    /// be handled (it may still be lost: see the node's delivery rules).
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// node.cast("counter", "alice", "incr").await?;
    /// # Ok(()) }
    /// ```
    pub async fn cast(
        &self,
        module: &str,
        key: &str,
        message: impl Into<bytes::Bytes>,
    ) -> Result<(), Error> {
        let url = self.url(&["v1", "keys", module, key, "cast"]);
        let message: bytes::Bytes = message.into();
        self.send(|http| http.post(url.clone()).body(message.clone()))
            .await?;
        Ok(())
    }

    /// Kill key `key`'s process on this node; whether one was live here.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let was_live = node.kill("counter", "alice").await?;
    /// # Ok(()) }
    /// ```
    pub async fn kill(&self, module: &str, key: &str) -> Result<bool, Error> {
        let url = self.url(&["v1", "keys", module, key]);
        let answer: serde_json::Value =
            json(self.send(|http| http.delete(url.clone())).await?).await?;
        Ok(answer["killed"].as_bool().unwrap_or(false))
    }

    /// The live keys on this node.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let keys = node.keys().await?;
    /// # Ok(()) }
    /// ```
    pub async fn keys(&self) -> Result<serde_json::Value, Error> {
        self.get_json("/v1/keys").await
    }

    /// A key's committed durable state: entries named from `prefix`, at
    /// most `limit` (1 to 1000), sorted by name.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// for entry in node.state("stored", "alice", "", 100).await? {
    ///     println!("{} = {:?}", entry.name, entry.bytes());
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn state(
        &self,
        module: &str,
        key: &str,
        prefix: &str,
        limit: u32,
    ) -> Result<Vec<StoredEntry>, Error> {
        let url = self.url(&["v1", "state", module, key]);
        let limit = limit.to_string();
        let mut answer: serde_json::Value = json(
            self.send(|http| {
                http.get(url.clone())
                    .query(&[("prefix", prefix), ("limit", &limit)])
            })
            .await?,
        )
        .await?;
        serde_json::from_value(answer["entries"].take()).map_err(|e| Error::Decode(e.to_string()))
    }

    /// A key's committed alarms.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// for alarm in node.alarms("reminders", "alice").await? {
    ///     println!("{} in {} ms", alarm.name, alarm.due_in_ms);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn alarms(&self, module: &str, key: &str) -> Result<Vec<StoredAlarm>, Error> {
        let url = self.url(&["v1", "alarms", module, key]);
        let mut answer: serde_json::Value =
            json(self.send(|http| http.get(url.clone())).await?).await?;
        serde_json::from_value(answer["alarms"].take()).map_err(|e| Error::Decode(e.to_string()))
    }

    /// The node's status: lease, partitions, members, modules.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let status = node.status().await?;
    /// println!("lease {}", status["lease"]);
    /// # Ok(()) }
    /// ```
    pub async fn status(&self) -> Result<serde_json::Value, Error> {
        self.get_json("/v1/status").await
    }

    /// The whole cluster as the dashboard sees it (admin only).
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let cluster = node.cluster().await?;
    /// # Ok(()) }
    /// ```
    pub async fn cluster(&self) -> Result<serde_json::Value, Error> {
        self.get_json("/v1/cluster").await
    }

    /// Keys this node fenced and still holds in limbo.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let limbo = node.limbo().await?;
    /// # Ok(()) }
    /// ```
    pub async fn limbo(&self) -> Result<serde_json::Value, Error> {
        self.get_json("/v1/limbo").await
    }

    /// The node's metrics, in the Prometheus text format.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let text = node.metrics().await?;
    /// assert!(text.contains("fief_"));
    /// # Ok(()) }
    /// ```
    pub async fn metrics(&self) -> Result<String, Error> {
        let url = self.url(&["metrics"]);
        self.send(|http| http.get(url.clone()))
            .await?
            .text()
            .await
            .map_err(|e| Error::Decode(e.to_string()))
    }

    /// Leave the cluster gracefully: hand every partition on, then stop.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let report = node.leave().await?;
    /// assert!(report.lost_states.is_empty());
    /// # Ok(()) }
    /// ```
    pub async fn leave(&self) -> Result<LeaveReport, Error> {
        let url = self.url(&["v1", "leave"]);
        json(self.send(|http| http.post(url.clone())).await?).await
    }

    /// A cache entry, or `None` if there is none.
    ///
    /// ```no_run
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// if let Some(entry) = node.cache_get("sessions", "alice").await? {
    ///     println!("version {}", entry.version);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn cache_get(&self, namespace: &str, key: &str) -> Result<Option<CacheEntry>, Error> {
        let url = self.url(&["v1", "cache", namespace, key]);
        let response = match self.send(|http| http.get(url.clone())).await {
            Err(Error::Api(e)) if e.status == 404 && e.code == "not_found" => return Ok(None),
            other => other?,
        };
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim_matches('"').to_owned())
        };
        let version = header("etag")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::Decode("a cache entry without a version (ETag)".to_owned()))?;
        let expires_in_ms = header("x-fief-expires-in-ms").and_then(|v| v.parse().ok());
        let value = response
            .bytes()
            .await
            .map_err(|e| Error::Decode(e.to_string()))?
            .to_vec();
        Ok(Some(CacheEntry {
            value,
            version,
            expires_in_ms,
        }))
    }

    /// Write a cache entry (for `ttl` if given, under `expect`); its new
    /// version.
    ///
    /// ```no_run
    /// # use fief_client::CacheExpect;
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// let ttl = Some(std::time::Duration::from_secs(10));
    /// let version = node.cache_put("sessions", "alice", "token", ttl, CacheExpect::Absent).await?;
    /// # Ok(()) }
    /// ```
    pub async fn cache_put(
        &self,
        namespace: &str,
        key: &str,
        value: impl Into<bytes::Bytes>,
        ttl: Option<Duration>,
        expect: CacheExpect,
    ) -> Result<u64, Error> {
        let url = self.url(&["v1", "cache", namespace, key]);
        let value: bytes::Bytes = value.into();
        let ttl = ttl.map(|t| format!("{}ms", t.as_millis()));
        let answer: serde_json::Value = json(
            self.send(|http| {
                let mut request = expect_header(http.put(url.clone()), expect).body(value.clone());
                if let Some(ttl) = &ttl {
                    request = request.query(&[("ttl", ttl)]);
                }
                request
            })
            .await?,
        )
        .await?;
        answer["version"]
            .as_u64()
            .ok_or_else(|| Error::Decode(format!("no version in {answer}")))
    }

    /// Delete a cache entry under `expect`; whether there was one.
    ///
    /// ```no_run
    /// # use fief_client::CacheExpect;
    /// # async fn run(node: fief_client::Client) -> Result<(), fief_client::Error> {
    /// node.cache_delete("sessions", "alice", CacheExpect::Version(3)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn cache_delete(
        &self,
        namespace: &str,
        key: &str,
        expect: CacheExpect,
    ) -> Result<bool, Error> {
        let url = self.url(&["v1", "cache", namespace, key]);
        let answer: serde_json::Value = json(
            self.send(|http| expect_header(http.delete(url.clone()), expect))
                .await?,
        )
        .await?;
        Ok(answer["deleted"].as_bool().unwrap_or(false))
    }
}

fn expect_header(request: reqwest::RequestBuilder, expect: CacheExpect) -> reqwest::RequestBuilder {
    match expect {
        CacheExpect::Any => request,
        CacheExpect::Absent => request.header("if-none-match", "*"),
        CacheExpect::Version(v) => request.header("if-match", format!("\"{v}\"")),
    }
}
