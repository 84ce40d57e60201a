//! The optional KV event plane (issue 43 item 3): one copy of each worker's KV events, however
//! many gateways read them.
//!
//! Without it every gateway opens a gRPC `KvEvents` stream to every worker, so a worker sends
//! each event once per gateway. With it, a worker publishes each `KvEventsResponse` message (the
//! very message the gRPC stream carries: a snapshot, an event or a batch, with its incarnation
//! and sequence numbers) once to a NATS JetStream stream, on a subject of its own
//! ([`subject`]); gateways follow each worker's subject from the oldest message the stream
//! still holds, and apply the messages with the same pure `ingest` the gRPC path uses. The
//! stream keeps a bounded history ([`EventPlaneConfig::max_age_secs`], `max_bytes`), so a
//! gateway that starts late catches up from it; when the history no longer reaches back to
//! what the gateway needs (a gap, a trimmed start), the ingest rules ask for a snapshot, which
//! the gateway takes from the worker over gRPC.
//!
//! [`config`] holds the settings and flags; [`server`] runs a `nats-server` (for `switchyard up
//! --event-plane embedded` and the tests); this file connects, names subjects, publishes and
//! follows.

pub mod config;
pub mod server;

use std::pin::Pin;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::{Stream, StreamExt};
use prost::Message;
use switchyard_proto::v1;

pub use config::{EventPlaneArgs, EventPlaneConfig, Storage};

/// An event-plane failure: the NATS server is unreachable or refused, or a message on the
/// stream is not ours. Retrying helps with the first kind (the callers back off and retry).
#[derive(Debug, thiserror::Error)]
pub enum PlaneError {
    #[error("cannot connect to the event plane at {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: BoxError,
    },
    #[error("cannot read the event plane's TLS or credential settings: {0}")]
    Settings(String),
    #[error("event plane stream {stream}: {source}")]
    Stream {
        stream: String,
        #[source]
        source: BoxError,
    },
    #[error("cannot publish to the event plane: {0}")]
    Publish(#[source] BoxError),
    #[error("cannot follow {subject} on the event plane: {source}")]
    Follow {
        subject: String,
        #[source]
        source: BoxError,
    },
    #[error("a message on {subject} is not a kv events message: {source}")]
    Decode {
        subject: String,
        #[source]
        source: prost::DecodeError,
    },
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Messages one worker's subject yields, oldest first.
pub type Follow = Pin<Box<dyn Stream<Item = Result<v1::KvEventsResponse, PlaneError>> + Send>>;

/// A connection to the event plane and the cluster's stream on it.
#[derive(Debug, Clone)]
pub struct EventPlane {
    jetstream: jetstream::Context,
    stream: String,
    cluster: String,
}

/// How long a publish waits for the stream's acknowledgement.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);

impl EventPlane {
    /// Connects to the plane as `client_name` and makes sure the cluster's stream exists (it is
    /// created with `config`'s history bounds when it does not; an existing stream keeps its
    /// own).
    pub async fn connect(
        config: &EventPlaneConfig,
        cluster: &str,
        client_name: &str,
    ) -> Result<Self, PlaneError> {
        let url = config.url.clone().unwrap_or_default();
        let mut options = async_nats::ConnectOptions::new()
            .name(client_name)
            .connection_timeout(Duration::from_secs(5))
            .request_timeout(Some(ACK_TIMEOUT));
        if let (Some(user), Some(password)) = (&config.user, &config.password) {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &config.token {
            options = options.token(token.clone());
        }
        if let Some(ca) = &config.tls_ca {
            if !ca.is_file() {
                return Err(PlaneError::Settings(format!(
                    "CA file {} does not exist",
                    ca.display()
                )));
            }
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if config.tls() {
            options = options.require_tls(true);
        }
        let servers: Vec<async_nats::ServerAddr> = url
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.parse())
            .collect::<Result<_, _>>()
            .map_err(|e: std::io::Error| PlaneError::Connect {
                url: url.clone(),
                source: Box::new(e),
            })?;
        let client = options
            .connect(servers)
            .await
            .map_err(|e| PlaneError::Connect {
                url: url.clone(),
                source: Box::new(e),
            })?;
        let mut jetstream = jetstream::new(client);
        jetstream.set_timeout(ACK_TIMEOUT);
        let plane = Self {
            jetstream,
            stream: stream_name(cluster),
            cluster: cluster.to_owned(),
        };
        plane.ensure_stream(config).await?;
        Ok(plane)
    }

    async fn ensure_stream(&self, config: &EventPlaneConfig) -> Result<(), PlaneError> {
        let wanted = stream::Config {
            name: self.stream.clone(),
            description: Some(format!(
                "Switchyard KV events of cluster {:?}, one subject per worker",
                self.cluster
            )),
            subjects: vec![format!("{}.>", subject_prefix(&self.cluster))],
            max_age: Duration::from_secs(config.max_age_secs),
            max_bytes: config.max_bytes,
            storage: match config.storage {
                Storage::File => stream::StorageType::File,
                Storage::Memory => stream::StorageType::Memory,
            },
            num_replicas: config.replicas,
            discard: stream::DiscardPolicy::Old,
            ..Default::default()
        };
        self.jetstream
            .get_or_create_stream(wanted)
            .await
            .map_err(|e| PlaneError::Stream {
                stream: self.stream.clone(),
                source: Box::new(e),
            })?;
        Ok(())
    }

    /// The largest message the server takes, in bytes (its `max_payload`, 1 MiB by default).
    pub fn max_payload(&self) -> usize {
        self.jetstream.client().max_payload()
    }

    /// The subject `worker`'s KV events of `model` go to.
    pub fn subject(&self, model: &str, worker: &str) -> String {
        subject(&self.cluster, model, worker)
    }

    /// Publishes one message and waits until the stream has stored it.
    pub async fn publish(
        &self,
        subject: &str,
        message: &v1::KvEventsResponse,
    ) -> Result<(), PlaneError> {
        let ack = self
            .jetstream
            .publish(subject.to_owned(), message.encode_to_vec().into())
            .await
            .map_err(|e| PlaneError::Publish(Box::new(e)))?;
        ack.await.map_err(|e| PlaneError::Publish(Box::new(e)))?;
        Ok(())
    }

    /// Follows `subject` from the oldest message the stream still holds, in order (an ordered
    /// consumer: ephemeral, no acknowledgements, recreated by the client where it left off
    /// when it misses a message or the connection drops).
    pub async fn follow(&self, subject: &str) -> Result<Follow, PlaneError> {
        let follow_error = |e: BoxError| PlaneError::Follow {
            subject: subject.to_owned(),
            source: e,
        };
        let stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .map_err(|e| follow_error(Box::new(e)))?;
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: subject.to_owned(),
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|e| follow_error(Box::new(e)))?;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| follow_error(Box::new(e)))?;
        let subject = subject.to_owned();
        Ok(Box::pin(messages.map(move |item| match item {
            Ok(message) => {
                v1::KvEventsResponse::decode(message.message.payload.as_ref()).map_err(|source| {
                    PlaneError::Decode {
                        subject: subject.clone(),
                        source,
                    }
                })
            }
            Err(e) => Err(PlaneError::Follow {
                subject: subject.clone(),
                source: Box::new(e),
            }),
        })))
    }

    /// Whether the stream holds any message of `subject` (a history trimmed to nothing holds
    /// none, and then only a snapshot tells what the worker has).
    pub async fn holds(&self, subject: &str) -> Result<bool, PlaneError> {
        let stream_error = |e: BoxError| PlaneError::Stream {
            stream: self.stream.clone(),
            source: e,
        };
        let stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .map_err(|e| stream_error(Box::new(e)))?;
        match stream.get_last_raw_message_by_subject(subject).await {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound) => {
                Ok(false)
            }
            Err(e) => Err(stream_error(Box::new(e))),
        }
    }

    /// Messages the stream holds now, and the oldest and newest stream sequence numbers.
    pub async fn held(&self) -> Result<(u64, u64, u64), PlaneError> {
        let stream_error = |e: BoxError| PlaneError::Stream {
            stream: self.stream.clone(),
            source: e,
        };
        let mut stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .map_err(|e| stream_error(Box::new(e)))?;
        let info = stream.info().await.map_err(|e| stream_error(Box::new(e)))?;
        Ok((
            info.state.messages,
            info.state.first_sequence,
            info.state.last_sequence,
        ))
    }

    /// Drops every message of `subject` from the stream (what a history bound does to old
    /// messages; for tests and operators).
    pub async fn purge(&self, subject: &str) -> Result<u64, PlaneError> {
        let stream_error = |e: BoxError| PlaneError::Stream {
            stream: self.stream.clone(),
            source: e,
        };
        let stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .map_err(|e| stream_error(Box::new(e)))?;
        let purged = stream
            .purge()
            .filter(subject)
            .await
            .map_err(|e| stream_error(Box::new(e)))?;
        Ok(purged.purged)
    }
}

/// The JetStream stream of `cluster`'s KV events.
pub fn stream_name(cluster: &str) -> String {
    format!("SWITCHYARD_KV_{}", token(cluster))
}

fn subject_prefix(cluster: &str) -> String {
    format!("switchyard.{}.kv", token(cluster))
}

/// The subject of one worker's KV events: `switchyard.<cluster>.kv.<model>.<worker>`, each name
/// escaped into one subject token.
pub fn subject(cluster: &str, model: &str, worker: &str) -> String {
    format!(
        "{}.{}.{}",
        subject_prefix(cluster),
        token(model),
        token(worker)
    )
}

/// `name` as one NATS subject token (and a valid stream-name part): letters, digits, `-` and
/// `_` stay, every other byte becomes `%XX`, so distinct names stay distinct and none holds the
/// `.`, `*`, `>`, `/` or whitespace NATS gives a meaning to. An empty name is `%`.
fn token(name: &str) -> String {
    if name.is_empty() {
        return "%".into();
    }
    let mut out = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_single_tokens_and_stay_distinct() {
        assert_eq!(
            subject("dev", "meta-llama/Llama-3.1-8B", "w.1"),
            "switchyard.dev.kv.meta-llama%2FLlama-3%2E1-8B.w%2E1"
        );
        assert_ne!(subject("c", "a.b", "c"), subject("c", "a", "b.c"));
        assert_ne!(token("a b"), token("a_b"));
        assert_eq!(token(""), "%");
        for name in ["x*y", "x>y", "x y", "x\ty", "é"] {
            let t = token(name);
            assert!(
                !t.contains(['.', '*', '>', ' ', '\t', '/']) && t.is_ascii(),
                "{t}"
            );
        }
        assert_eq!(stream_name("prod.eu"), "SWITCHYARD_KV_prod%2Eeu");
    }
}
