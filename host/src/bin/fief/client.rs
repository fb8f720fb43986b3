//! How client commands reach a node: a [`fief_client::Client`] for the
//! `--node` each command names, built with the global `--token` and
//! `--ca-cert` (read once by `run`). The API's operations, errors and
//! retries are the client crate's; this module only holds the settings.

use anyhow::Context;

/// The settings every client command's [`node`] uses.
struct Settings {
    token: Option<String>,
    ca_pem: Option<Vec<u8>>,
}

static SETTINGS: std::sync::OnceLock<Settings> = std::sync::OnceLock::new();

/// Keep `--token` and `--ca-cert` (read now, so a bad file fails before any
/// request) for the commands' clients.
pub(crate) fn configure(
    token: Option<&str>,
    ca_cert: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let ca_pem = ca_cert
        .map(|path| {
            std::fs::read(path)
                .with_context(|| format!("reading the CA certificate {}", path.display()))
        })
        .transpose()?;
    let settings = Settings {
        token: token.map(str::to_owned),
        ca_pem,
    };
    // A check now, so a bad token or CA is refused before the command runs.
    build("http://127.0.0.1", &settings)?;
    SETTINGS
        .set(settings)
        .map_err(|_| anyhow::anyhow!("the client settings were set twice"))
}

fn build(node: &str, settings: &Settings) -> anyhow::Result<fief_client::Client> {
    let mut builder = fief_client::Client::builder(node);
    if let Some(token) = &settings.token {
        builder = builder.token(token.clone());
    }
    if let Some(pem) = &settings.ca_pem {
        builder = builder.ca_cert_pem(pem.clone());
    }
    builder.build().map_err(|e| match e {
        fief_client::Error::InvalidInput(why) if why.contains("token") => {
            anyhow::anyhow!("--token / FIEF_TOKEN must be printable ASCII")
        }
        e => e.into(),
    })
}

/// The client of the node at `node` (`--node`).
pub(crate) fn node(node: &str) -> anyhow::Result<fief_client::Client> {
    let settings = SETTINGS.get_or_init(|| Settings {
        token: None,
        ca_pem: None,
    });
    build(node, settings)
}
