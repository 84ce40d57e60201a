//! What a pod means for routing, with no I/O: whether it serves (ready, an IP, not
//! terminating) and where its Switchyard sidecar and its engine listen.

use std::fmt;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;

/// A port of a pod's containers: a number, or the name of a declared container port (as a
/// Service's `targetPort` may be), so pods of one pool may listen on different numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortRef {
    Number(u16),
    Named(String),
}

impl PortRef {
    /// `8000` or `grpc` (an IANA service name: 1–15 lowercase letters, digits and '-', with
    /// a letter).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
            return match text.parse::<u16>() {
                Ok(port) if port > 0 => Ok(Self::Number(port)),
                _ => Err(format!("port {text:?} is not between 1 and 65535")),
            };
        }
        let named = (1..=15).contains(&text.len())
            && text
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && text.bytes().any(|b| b.is_ascii_lowercase())
            && !text.starts_with('-')
            && !text.ends_with('-');
        if named {
            Ok(Self::Named(text.to_owned()))
        } else {
            Err(format!(
                "port {text:?} is neither a number (1-65535) nor a container port name (1-15 \
                 lowercase letters, digits and '-')"
            ))
        }
    }

    /// The port number in `pod`: the number itself, or the container port so named.
    pub fn resolve(&self, pod: &Pod) -> Option<u16> {
        match self {
            Self::Number(port) => Some(*port),
            Self::Named(name) => pod
                .spec
                .as_ref()?
                .containers
                .iter()
                .flat_map(|c| c.ports.iter().flatten())
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .and_then(|p| u16::try_from(p.container_port).ok())
                .filter(|p| *p > 0),
        }
    }
}

impl fmt::Display for PortRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Number(port) => write!(f, "{port}"),
            Self::Named(name) => f.write_str(name),
        }
    }
}

/// Where a serving pod's sidecar and engine are reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTarget {
    /// The Switchyard worker sidecar's gRPC address (`ip:port`).
    pub worker_address: String,
    /// The engine's HTTP API (`ip:port`) as the proxy reaches it, when the engine port is
    /// known (`--k8s-engine-port` or the InferencePool's target port).
    pub engine_endpoint: Option<String>,
}

/// Why a pod does not serve (for the log), or where it serves.
pub fn target(
    pod: &Pod,
    worker_port: &PortRef,
    engine_port: Option<&PortRef>,
) -> Result<PodTarget, &'static str> {
    if pod.metadata.deletion_timestamp.is_some() {
        return Err("terminating");
    }
    let status = pod.status.as_ref().ok_or("no status yet")?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return Err("not ready");
    }
    let ip = status
        .pod_ip
        .as_deref()
        .and_then(|ip| ip.parse::<IpAddr>().ok())
        .ok_or("no pod IP")?;
    let worker = worker_port
        .resolve(pod)
        .ok_or("no container port of the sidecar's name")?;
    let engine = match engine_port {
        Some(port) => Some(
            port.resolve(pod)
                .ok_or("no container port of the engine's name")?,
        ),
        None => None,
    };
    let at = |port: u16| std::net::SocketAddr::new(ip, port).to_string();
    Ok(PodTarget {
        worker_address: at(worker),
        engine_endpoint: engine.map(at),
    })
}

/// A pod's name, for logs and as the key of what the watch knows.
pub fn name(pod: &Pod) -> Option<&str> {
    pod.metadata.name.as_deref()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ready: &str, ip: Option<&str>) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "engine-0"},
            "spec": {"containers": [
                {"name": "vllm", "ports": [{"name": "http", "containerPort": 8000}]},
                {"name": "switchyard", "ports": [{"name": "worker", "containerPort": 50051}]}
            ]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}
        }))
        .unwrap()
    }

    #[test]
    fn ports_are_numbers_or_container_port_names() {
        assert_eq!(PortRef::parse("8000"), Ok(PortRef::Number(8000)));
        assert_eq!(
            PortRef::parse("worker"),
            Ok(PortRef::Named("worker".into()))
        );
        for bad in [
            "0",
            "70000",
            "",
            "Worker",
            "-x",
            "much-too-long-name",
            "a b",
            "123-",
        ] {
            assert!(PortRef::parse(bad).is_err(), "{bad}");
        }
        let pod = pod("True", Some("10.0.0.7"));
        assert_eq!(PortRef::parse("worker").unwrap().resolve(&pod), Some(50051));
        assert_eq!(PortRef::parse("http").unwrap().resolve(&pod), Some(8000));
        assert_eq!(PortRef::parse("metrics").unwrap().resolve(&pod), None);
    }

    #[test]
    fn a_ready_pod_with_an_ip_serves_at_its_ports() {
        let worker = PortRef::Named("worker".into());
        let engine = PortRef::Named("http".into());
        let target = target(&pod("True", Some("10.0.0.7")), &worker, Some(&engine)).unwrap();
        assert_eq!(target.worker_address, "10.0.0.7:50051");
        assert_eq!(target.engine_endpoint.as_deref(), Some("10.0.0.7:8000"));
        let v6 = super::target(&pod("True", Some("fd00::7")), &worker, None).unwrap();
        assert_eq!(v6.worker_address, "[fd00::7]:50051");
        assert_eq!(v6.engine_endpoint, None);
    }

    #[test]
    fn unready_addressless_terminating_and_portless_pods_do_not_serve() {
        let worker = PortRef::Named("worker".into());
        assert_eq!(
            target(&pod("False", Some("10.0.0.7")), &worker, None),
            Err("not ready")
        );
        assert_eq!(target(&pod("True", None), &worker, None), Err("no pod IP"));
        let mut leaving = pod("True", Some("10.0.0.7"));
        leaving.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                serde_json::from_value(serde_json::json!("2026-01-01T00:00:00Z")).unwrap(),
            ));
        assert_eq!(target(&leaving, &worker, None), Err("terminating"));
        let other = PortRef::Named("grpc".into());
        assert!(target(&pod("True", Some("10.0.0.7")), &other, None).is_err());
    }
}
