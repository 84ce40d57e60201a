//! The optional KV event plane (issue 43 item 3): one copy of each worker's KV events, however
//! many gateways read them.
//!
//! Without it every gateway opens a gRPC `KvEvents` stream to every worker, so a worker sends
//! each event once per gateway. With it, a worker publishes each `KvEventsResponse` message (the
//! very message the gRPC stream carries: a snapshot, an event or a batch, with its incarnation
//! and sequence numbers) once to a NATS JetStream stream, on a subject of its own
//! ([`subject`]); each gateway follows every worker's subject of a model with one consumer
//! ([`model_filter`], [`EventPlane::follow_model`]) from the oldest message the stream still
//! holds, hands each message to its worker's follower by the subject's last token, and applies
//! it with the same pure `ingest` the gRPC path uses. The stream keeps a bounded history
//! ([`EventPlaneConfig::max_age_secs`], `max_bytes`), so a gateway that starts late catches up
//! from it; when the history no longer reaches back to what the gateway needs (a gap, a
//! trimmed start), the ingest rules ask for a snapshot, which the gateway takes from the
//! worker over gRPC.
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
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where [`EventPlane::follow_model`] starts reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// From the oldest message the stream still holds.
    Oldest,
    /// Right after this stream sequence number (a reader resuming where it was), or from the
    /// oldest message when the stream no longer holds what follows it ([`ModelFollow::resumed`]).
    After(u64),
}

/// One message read from a model's subjects.
#[derive(Debug)]
pub struct Delivered {
    /// The last token of its subject: [`subject_token`] of the worker that published it.
    pub worker_token: String,
    /// Its sequence number in the cluster's stream (every model's messages together).
    pub stream_sequence: u64,
    /// Messages of the model the stream held beyond this one when it was delivered.
    pub pending: u64,
    /// The size of its payload.
    pub bytes: usize,
    /// The message, or why its payload is not a KV events message.
    pub message: Result<v1::KvEventsResponse, prost::DecodeError>,
}

/// The messages of one model's subjects, in stream order; an error ends what they can tell
/// (the reader follows again, [`Start::After`] the last one it read).
pub type ModelMessages = Pin<Box<dyn Stream<Item = Result<Delivered, PlaneError>> + Send>>;

/// A consumer following one model ([`EventPlane::follow_model`]).
pub struct ModelFollow {
    pub messages: ModelMessages,
    /// Messages of the model the stream held ahead of the consumer when it was made (0: it is
    /// caught up already).
    pub pending: u64,
    /// The stream's last sequence number when the consumer was made: a message past it was
    /// published after.
    pub last_at_start: u64,
    /// Whether it starts where it was asked to. False when [`Start::After`] could not be
    /// honoured (the stream was trimmed past that point, or made anew by a server that lost its
    /// store): it starts from the oldest message, and what lay in between is lost to the reader.
    pub resumed: bool,
}

impl std::fmt::Debug for ModelFollow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFollow")
            .field("pending", &self.pending)
            .field("last_at_start", &self.last_at_start)
            .field("resumed", &self.resumed)
            .finish_non_exhaustive()
    }
}

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

    /// Follows every worker's subject of `model` with one consumer (an ordered consumer on
    /// `switchyard.<cluster>.kv.<model>.>`: ephemeral, no acknowledgements, recreated by the
    /// client where it left off when it misses a message or the connection drops), in stream
    /// order, from `start`. However many workers serve the model, the server keeps one consumer
    /// for this reader: one per worker was 10,000 per gateway at 10,000 workers, more than
    /// JetStream's API answered in time (`docs/scaling.md`).
    pub async fn follow_model(&self, model: &str, start: Start) -> Result<ModelFollow, PlaneError> {
        let filter = model_filter(&self.cluster, model);
        let follow_error = |e: BoxError| PlaneError::Follow {
            subject: filter.clone(),
            source: e,
        };
        let mut stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .map_err(|e| follow_error(Box::new(e)))?;
        let held = stream
            .info()
            .await
            .map_err(|e| follow_error(Box::new(e)))?
            .state
            .clone();
        let (deliver_policy, resumed) = match start {
            Start::Oldest => (consumer::DeliverPolicy::All, true),
            // The stream still holds what follows `seq` (nothing was trimmed in between, and the
            // stream was not made anew by a server that lost its store).
            Start::After(seq) if held.last_sequence >= seq && held.first_sequence <= seq + 1 => (
                consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: seq + 1,
                },
                true,
            ),
            Start::After(_) => (consumer::DeliverPolicy::All, false),
        };
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: filter.clone(),
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(|e| follow_error(Box::new(e)))?;
        let pending = consumer.cached_info().num_pending;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| follow_error(Box::new(e)))?;
        let subject = filter.clone();
        let messages = messages.map(move |item| {
            let message = item.map_err(|e| PlaneError::Follow {
                subject: subject.clone(),
                source: Box::new(e),
            })?;
            let info = message.info().map_err(|e| PlaneError::Follow {
                subject: subject.clone(),
                source: e,
            })?;
            let (stream_sequence, pending) = (info.stream_sequence, info.pending);
            let payload = message.message.payload.as_ref();
            let worker_token = message
                .message
                .subject
                .as_str()
                .rsplit('.')
                .next()
                .unwrap_or_default()
                .to_owned();
            Ok(Delivered {
                worker_token,
                stream_sequence,
                pending,
                bytes: payload.len(),
                message: v1::KvEventsResponse::decode(payload),
            })
        });
        Ok(ModelFollow {
            messages: Box::pin(messages),
            pending,
            last_at_start: held.last_sequence,
            resumed,
        })
    }

    /// How many consumers the cluster's stream has, every reader's together (each gateway
    /// holds one per model it follows).
    pub async fn consumer_count(&self) -> Result<usize, PlaneError> {
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
        Ok(info.state.consumer_count)
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
    format!("SWITCHYARD_KV_{}", subject_token(cluster))
}

fn subject_prefix(cluster: &str) -> String {
    format!("switchyard.{}.kv", subject_token(cluster))
}

/// The subject of one worker's KV events: `switchyard.<cluster>.kv.<model>.<worker>`, each name
/// escaped into one subject token.
pub fn subject(cluster: &str, model: &str, worker: &str) -> String {
    format!(
        "{}.{}.{}",
        subject_prefix(cluster),
        subject_token(model),
        subject_token(worker)
    )
}

/// The filter of every worker's subject of `model`: `switchyard.<cluster>.kv.<model>.>`.
pub fn model_filter(cluster: &str, model: &str) -> String {
    format!("{}.{}.>", subject_prefix(cluster), subject_token(model))
}

/// `name` as one NATS subject token (and a valid stream-name part): letters, digits, `-` and
/// `_` stay, every other byte becomes `%XX`, so distinct names stay distinct and none holds the
/// `.`, `*`, `>`, `/` or whitespace NATS gives a meaning to. An empty name is `%`. A worker id
/// so escaped is the last token of its subject ([`Delivered::worker_token`]).
pub fn subject_token(name: &str) -> String {
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
        assert_ne!(subject_token("a b"), subject_token("a_b"));
        assert_eq!(subject_token(""), "%");
        for name in ["x*y", "x>y", "x y", "x\ty", "é"] {
            let t = subject_token(name);
            assert!(
                !t.contains(['.', '*', '>', ' ', '\t', '/']) && t.is_ascii(),
                "{t}"
            );
        }
        assert_eq!(stream_name("prod.eu"), "SWITCHYARD_KV_prod%2Eeu");
    }

    async fn next(follow: &mut ModelFollow) -> Delivered {
        // A hang guard only: the messages are in the stream before they are asked for.
        tokio::time::timeout(Duration::from_secs(20), follow.messages.next())
            .await
            .expect("a message within the guard")
            .expect("the consumer goes on")
            .expect("no error")
    }

    fn event(worker: &str, seq: u64) -> v1::KvEventsResponse {
        v1::KvEventsResponse {
            logged_at_unix_us: 0,
            worker_id: worker.into(),
            incarnation: 1,
            payload: Some(v1::kv_events_response::Payload::Event(v1::KvEvent {
                seq,
                kind: None,
            })),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_consumer_reads_every_worker_of_a_model_and_resumes_after_a_sequence() {
        let server = server::NatsServer::start(server::ServerAuth::Open).expect("nats-server");
        let config = EventPlaneConfig {
            url: Some(server.url()),
            storage: Storage::Memory,
            ..EventPlaneConfig::default()
        };
        let plane = EventPlane::connect(&config, "c", "test").await.unwrap();
        let published = [
            ("m.1", "w.a", 0),
            ("other", "w-c", 0),
            ("m.1", "w-b", 0),
            ("m.1", "w.a", 1),
        ];
        for (model, worker, seq) in published {
            plane
                .publish(&plane.subject(model, worker), &event(worker, seq))
                .await
                .unwrap();
        }
        let mut follow = plane.follow_model("m.1", Start::Oldest).await.unwrap();
        assert_eq!((follow.pending, follow.resumed), (3, true), "{follow:?}");
        let mut read = Vec::new();
        for _ in 0..3 {
            read.push(next(&mut follow).await);
        }
        let seen: Vec<(String, u64, String)> = read
            .iter()
            .map(|d| {
                let m = d.message.as_ref().unwrap();
                (d.worker_token.clone(), event_seq(m), m.worker_id.clone())
            })
            .collect();
        assert_eq!(
            seen,
            [
                (subject_token("w.a"), 0, "w.a".to_owned()),
                ("w-b".to_owned(), 0, "w-b".to_owned()),
                (subject_token("w.a"), 1, "w.a".to_owned()),
            ]
        );
        assert_eq!(
            read.iter().map(|d| d.pending).collect::<Vec<_>>(),
            [2, 1, 0]
        );
        assert_eq!(
            plane.consumer_count().await.unwrap(),
            1,
            "one consumer for the model"
        );
        // A worker that starts publishing after the consumer was made is read as well.
        plane
            .publish(&plane.subject("m.1", "w-new"), &event("w-new", 0))
            .await
            .unwrap();
        let late = next(&mut follow).await;
        assert_eq!(late.worker_token, "w-new");
        assert!(late.stream_sequence > follow.last_at_start);

        // Resuming after the first message reads on from the second.
        let mut resumed = plane
            .follow_model("m.1", Start::After(read[0].stream_sequence))
            .await
            .unwrap();
        assert!(resumed.resumed);
        assert_eq!(
            next(&mut resumed).await.stream_sequence,
            read[1].stream_sequence
        );
        // A history purged past that point cannot be resumed from: it starts from the oldest.
        plane.purge(">").await.unwrap();
        let restarted = plane
            .follow_model("m.1", Start::After(read[0].stream_sequence))
            .await
            .unwrap();
        assert!(!restarted.resumed);
        assert_eq!(restarted.pending, 0);
    }

    fn event_seq(message: &v1::KvEventsResponse) -> u64 {
        match &message.payload {
            Some(v1::kv_events_response::Payload::Event(e)) => e.seq,
            _ => u64::MAX,
        }
    }
}
