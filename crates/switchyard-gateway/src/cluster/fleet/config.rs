//! `[fleet]`: whether this replica shares sessions with the other gateway replicas of its
//! cluster, and how it names and announces itself.

use serde::Deserialize;

/// `[fleet]` in the gateway's configuration, or the `--fleet-sessions`, `--replica-id` and
/// `--advertise` flags.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// Forward a turn of a session (`x-session-id`) to the replica that owns the session.
    pub share_sessions: bool,
    /// This replica's id among the live ones (the pod name); default: its advertised address.
    pub replica_id: Option<String>,
    /// `host:port` where the other replicas reach this one's HTTP API; default: the bound
    /// listen address, when that is not a wildcard (0.0.0.0 or ::).
    pub advertise: Option<String>,
    /// How often the live replicas are listed from the registry.
    pub refresh_ms: u64,
    /// The lease of this replica's registry entry: how long a replica that died is still
    /// forwarded to (each of those turns then falls back to local routing).
    pub lease_ttl_secs: u64,
    /// How long a forward waits to connect to the owner before serving the turn here.
    pub connect_timeout_ms: u64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            share_sessions: false,
            replica_id: None,
            advertise: None,
            refresh_ms: 1000,
            lease_ttl_secs: 10,
            connect_timeout_ms: 500,
        }
    }
}

impl FleetConfig {
    /// Checks the settings; one sentence naming the setting when one is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if !self.share_sessions {
            return Ok(());
        }
        if let Some(id) = &self.replica_id {
            let probe = switchyard_registry::ReplicaInfo {
                id: id.clone(),
                address: "-".into(),
            };
            probe
                .validate()
                .map_err(|e| format!("fleet.replica_id: {e}"))?;
        }
        if let Some(address) = &self.advertise
            && !address.contains(':')
        {
            return Err(format!(
                "fleet.advertise {address:?} must be host:port (the address other replicas reach)"
            ));
        }
        if self.refresh_ms == 0 {
            return Err("fleet.refresh_ms must be at least 1".into());
        }
        if self.lease_ttl_secs < 2 {
            return Err("fleet.lease_ttl_secs must be at least 2 (etcd's shortest lease)".into());
        }
        if self.connect_timeout_ms == 0 {
            return Err("fleet.connect_timeout_ms must be at least 1".into());
        }
        Ok(())
    }
}

/// Flags and `SWITCHYARD_*` variables of `[fleet]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct FleetArgs {
    /// Share sessions with the other gateway replicas: a turn is forwarded to the replica that
    /// owns its `x-session-id` (needs etcd, or `switchyard up --gateways N`).
    #[arg(long = "fleet-sessions", env = "SWITCHYARD_FLEET_SESSIONS")]
    pub share_sessions: bool,
    /// This replica's id among the gateway replicas (the pod name).
    #[arg(long = "replica-id", env = "SWITCHYARD_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// host:port where the other replicas reach this one (the pod IP and the HTTP port).
    #[arg(long = "advertise", env = "SWITCHYARD_ADVERTISE")]
    pub advertise: Option<String>,
}

impl FleetArgs {
    pub fn apply(&self, config: &mut FleetConfig) {
        if self.share_sessions {
            config.share_sessions = true;
        }
        if self.replica_id.is_some() {
            config.replica_id.clone_from(&self.replica_id);
        }
        if self.advertise.is_some() {
            config.advertise.clone_from(&self.advertise);
        }
    }
}
