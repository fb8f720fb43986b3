//! The HTTP client every client command uses (built once from `--token`
//! and `--ca-cert`), the URLs it calls, and how a failure becomes one line:
//! a node that cannot be reached, or the API's error message and status.

use anyhow::Context;

/// Turn an API error response into a one-line error.
pub(crate) async fn api_error(response: reqwest::Response) -> anyhow::Error {
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or(text);
    anyhow::anyhow!("{message} (HTTP {status})")
}

/// The client every command uses, built once by `run` from `--token` and
/// `--ca-cert`.
pub(crate) static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();

pub(crate) fn client() -> reqwest::Client {
    CLIENT.get().cloned().unwrap_or_default()
}

/// An HTTP client that sends `token` (marked sensitive, so never logged)
/// and trusts `ca_cert` besides the system's roots.
pub(crate) fn build_client(
    token: Option<&str>,
    ca_cert: Option<&std::path::Path>,
) -> anyhow::Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder();
    if let Some(token) = token.map(str::trim).filter(|t| !t.is_empty()) {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| anyhow::anyhow!("--token / FIEF_TOKEN must be printable ASCII"))?;
        value.set_sensitive(true);
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(reqwest::header::AUTHORIZATION, value);
        builder = builder.default_headers(headers);
    }
    if let Some(path) = ca_cert {
        let pem = std::fs::read(path)
            .with_context(|| format!("reading the CA certificate {}", path.display()))?;
        for cert in reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("{} is not a PEM certificate", path.display()))?
        {
            builder = builder.add_root_certificate(cert);
        }
    }
    builder.build().context("building the HTTP client")
}

pub(crate) fn connect_error(node: &str) -> impl FnOnce(reqwest::Error) -> anyhow::Error + '_ {
    move |e| {
        anyhow::anyhow!(
            "cannot reach the node at {node}: {e} (is `fief node` running? pass --node URL)"
        )
    }
}

/// `node`'s URL with `segments` appended, each percent-encoded.
pub(crate) fn api_url(node: &str, segments: &[&str]) -> anyhow::Result<reqwest::Url> {
    let mut url =
        reqwest::Url::parse(node).with_context(|| format!("--node {node:?} is not a URL"))?;
    url.path_segments_mut()
        .map_err(|()| anyhow::anyhow!("--node {node:?} cannot take a path"))?
        .pop_if_empty()
        .extend(segments);
    Ok(url)
}

/// Send `request` to the node at `node`; a connection failure or an API
/// error becomes a one-line error.
pub(crate) async fn send(
    node: &str,
    request: reqwest::RequestBuilder,
) -> anyhow::Result<reqwest::Response> {
    let response = request.send().await.map_err(connect_error(node))?;
    if !response.status().is_success() {
        return Err(api_error(response).await);
    }
    Ok(response)
}

/// `GET {node}{path}` as JSON.
pub(crate) async fn get_json(node: &str, path: &str) -> anyhow::Result<serde_json::Value> {
    let url = format!("{}{path}", node.trim_end_matches('/'));
    Ok(send(node, client().get(&url)).await?.json().await?)
}
