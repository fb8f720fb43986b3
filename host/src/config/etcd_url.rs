//! The etcd arbiter's URL, `etcd://host:port[,host:port…]/prefix`, as a
//! configuration value: parsed (and its errors worded) here, where
//! `NodeConfig::validate` checks it and the etcd arbiter
//! (`crate::arbiter`, a layer above) reads it. It holds no connection.

/// A parsed `etcd://host:port[,host:port…]/prefix` arbiter URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdUrl {
    /// The client endpoints (`host:port`), tried in this order.
    pub endpoints: Vec<String>,
    /// The key prefix every key of Fief's goes under (starts with `/`, no
    /// trailing `/`).
    pub prefix: String,
}

impl EtcdUrl {
    /// Parse an `etcd://` URL.
    ///
    /// # Errors
    ///
    /// A message saying what is wrong with it and what a valid one looks
    /// like.
    pub fn parse(url: &str) -> Result<EtcdUrl, String> {
        let usage = "expected etcd://host:port[,host:port…]/prefix, for example \
                     etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/fief";
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| format!("arbiter {url:?} does not start with etcd://; {usage}"))?;
        let (hosts, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return Err(format!(
                "arbiter {url:?} names no key prefix (the path after the hosts): every key of \
                 Fief's goes under it; {usage}"
            ));
        }
        let endpoints: Vec<String> = hosts.split(',').map(str::to_owned).collect();
        for endpoint in &endpoints {
            let valid = endpoint.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty()
                    && !host.contains(['@', '?', '#', ' '])
                    && port.parse::<u16>().is_ok_and(|p| p != 0)
            });
            if !valid {
                return Err(format!(
                    "arbiter {url:?}: {endpoint:?} is not host:port (etcd's client port, \
                     usually 2379); {usage}"
                ));
            }
        }
        Ok(EtcdUrl {
            endpoints,
            prefix: format!("/{prefix}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_names_endpoints_and_a_prefix() {
        let url = EtcdUrl::parse("etcd://10.0.0.1:2379,etcd-b:2379,[::1]:2379/fief/prod/").unwrap();
        assert_eq!(
            url.endpoints,
            ["10.0.0.1:2379", "etcd-b:2379", "[::1]:2379"]
        );
        assert_eq!(url.prefix, "/fief/prod");
    }

    #[test]
    fn a_malformed_url_is_refused_saying_what_is_wrong() {
        for (url, says) in [
            ("postgres://x/y", "does not start with etcd://"),
            ("etcd://127.0.0.1:2379", "no key prefix"),
            ("etcd://127.0.0.1:2379/", "no key prefix"),
            ("etcd://127.0.0.1/fief", "not host:port"),
            ("etcd://127.0.0.1:2379,/fief", "not host:port"),
            ("etcd://:2379/fief", "not host:port"),
            ("etcd://a:70000/fief", "not host:port"),
            ("etcd://user@a:2379/fief", "not host:port"),
        ] {
            let err = EtcdUrl::parse(url).unwrap_err();
            assert!(
                err.contains(says) && err.contains("etcd://host:port"),
                "{url}: {err}"
            );
        }
    }
}
