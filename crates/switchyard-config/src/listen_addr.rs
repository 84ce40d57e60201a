//! Listen addresses as operators write them: `IP:PORT`, `[IPv6]:PORT` or `HOST:PORT`
//! (`localhost:8000`), resolved once when the configuration is read.

use std::net::{SocketAddr, ToSocketAddrs};

use serde::{Deserialize, Deserializer};

/// Parses a listen address; a host name is resolved and its first IPv4 address preferred (so
/// `localhost:8000` binds where `curl http://localhost:8000` first looks). The error is one
/// sentence naming the input. Usable as a clap `value_parser`.
pub fn parse_listen_addr(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let Some((host, port)) = text.rsplit_once(':') else {
        return Err(format!(
            "'{text}' is not a listen address: expected HOST:PORT (for example 127.0.0.1:8000 or localhost:8000)"
        ));
    };
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(format!(
            "'{text}' is not a listen address: expected HOST:PORT with a port from 0 to 65535"
        ));
    }
    let addrs: Vec<SocketAddr> = text
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve listen address '{text}': {e}"))?
        .collect();
    addrs
        .iter()
        .find(|addr| addr.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| format!("listen address '{text}' resolves to no address"))
}

/// `deserialize_with` for a listen address in a configuration file.
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse_listen_addr(&text).map_err(serde::de::Error::custom)
}

/// `deserialize_with` for an optional listen address in a configuration file.
pub fn deserialize_opt<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<SocketAddr>, D::Error> {
    Option::<String>::deserialize(deserializer)?
        .map(|text| parse_listen_addr(&text).map_err(serde::de::Error::custom))
        .transpose()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn takes_addresses_and_host_names() {
        assert_eq!(
            parse_listen_addr("127.0.0.1:8000").unwrap(),
            "127.0.0.1:8000".parse().unwrap()
        );
        assert_eq!(
            parse_listen_addr("[::1]:7000").unwrap(),
            "[::1]:7000".parse().unwrap()
        );
        let local = parse_listen_addr("localhost:8000").unwrap();
        assert!(local.ip().is_loopback(), "{local}");
        assert_eq!(local.port(), 8000);
        assert!(local.is_ipv4(), "IPv4 first: {local}");
    }

    #[test]
    fn refuses_what_is_not_an_address_with_a_sentence() {
        for bad in ["8000", "localhost", ":8000", "localhost:http", "host:70000"] {
            let err = parse_listen_addr(bad).unwrap_err();
            assert!(err.contains(bad), "{err}");
        }
        let err = parse_listen_addr("no-such-host.invalid:80").unwrap_err();
        assert!(err.contains("cannot resolve"), "{err}");
    }

    #[test]
    fn reads_from_a_config_file() {
        #[derive(Debug, serde::Deserialize)]
        struct Listen {
            #[serde(deserialize_with = "deserialize")]
            listen: SocketAddr,
            #[serde(default, deserialize_with = "deserialize_opt")]
            metrics: Option<SocketAddr>,
        }
        let parsed: Listen = toml::from_str("listen = \"localhost:9\"").unwrap();
        assert!(parsed.listen.ip().is_loopback());
        assert_eq!(parsed.metrics, None);
        let parsed: Listen =
            toml::from_str("listen = \"0.0.0.0:1\"\nmetrics = \"localhost:2\"").unwrap();
        assert_eq!(parsed.metrics.unwrap().port(), 2);
        let err = toml::from_str::<Listen>("listen = \"nowhere\"").unwrap_err();
        assert!(err.message().contains("nowhere"), "{err}");
    }
}
