//! Responses state: stored responses (`store: true`, `previous_response_id`,
//! `GET`/`DELETE /v1/responses/{id}`, `input_items`) and sealed reasoning for clients that store
//! nothing (`include: ["reasoning.encrypted_content"]`, Codex's default).
//!
//! A stored response is its response object, the input items of its request, and the whole
//! conversation so far as Responses items (the earlier turns, this input, this output), so a
//! request naming it as `previous_response_id` continues from those items. It lives in this
//! replica's memory (bounded in count, with a TTL) or, for replicas that must share it, in the
//! fleet's Redis (`SET … PX ttl`). Sealed reasoning is the reasoning text encrypted and
//! authenticated with a key only this deployment holds (ChaCha20-Poly1305, from `ring`): a
//! client carries it from one turn to the next and the gateway reads it back into the prompt.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use parking_lot::Mutex;
use redis::AsyncCommands;
use redis::aio::ConnectionManager;
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::access::quota::RedisConfig;
use crate::error::ApiError;

/// `[responses]`: where stored responses live and how reasoning is sealed.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesConfig {
    /// Most responses kept in memory; the oldest go first.
    pub max_entries: usize,
    /// Most bytes of responses kept in memory (each counted as its JSON): an agent's stored
    /// turn holds its whole conversation, so count alone does not bound memory.
    pub max_bytes: usize,
    /// How long a stored response can be read back or continued, in seconds.
    pub ttl_secs: u64,
    /// Keep responses in this Redis instead, shared by every replica.
    pub redis: Option<RedisConfig>,
    /// Prefix of every key in Redis.
    pub key_prefix: String,
    /// Longest wait for Redis per call, in milliseconds.
    pub store_timeout_ms: u64,
    /// Secret (any bytes) the reasoning-sealing key is derived from. Unset: the cluster secret
    /// when one is configured (so every replica reads every other's), else a key made at start
    /// (sealed reasoning then reads back only on this process).
    pub key_file: Option<PathBuf>,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self {
            max_entries: 10_000,
            max_bytes: 256 << 20,
            ttl_secs: 86_400,
            redis: None,
            key_prefix: "switchyard".to_owned(),
            store_timeout_ms: 1_000,
            key_file: None,
        }
    }
}

impl ResponsesConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.max_entries == 0 {
            return Err("responses.max_entries must be at least 1".into());
        }
        if self.max_bytes < 1 << 20 {
            return Err("responses.max_bytes must be at least 1 MiB".into());
        }
        if self.ttl_secs == 0 {
            return Err("responses.ttl_secs must be at least 1".into());
        }
        if let Some(redis) = &self.redis
            && !(redis.url.starts_with("redis://") || redis.url.starts_with("rediss://"))
        {
            return Err(format!(
                "responses.redis.url must start with redis:// or rediss://, got {:?}",
                redis.url
            ));
        }
        Ok(())
    }
}

/// Flags of `[responses]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ResponsesArgs {
    /// Keep stored responses (`store: true`) in this Redis, shared by every gateway replica.
    #[arg(long, env = "SWITCHYARD_RESPONSES_REDIS_URL")]
    pub responses_redis_url: Option<String>,
    /// Seconds a stored response can be read back or continued.
    #[arg(long, env = "SWITCHYARD_RESPONSES_TTL_SECS")]
    pub responses_ttl_secs: Option<u64>,
    /// Most stored responses kept in memory.
    #[arg(long, env = "SWITCHYARD_RESPONSES_MAX_ENTRIES")]
    pub responses_max_entries: Option<usize>,
    /// File holding the secret sealed reasoning's key is derived from.
    #[arg(long, env = "SWITCHYARD_RESPONSES_KEY_FILE")]
    pub responses_key_file: Option<PathBuf>,
}

impl ResponsesArgs {
    pub fn apply(&self, config: &mut ResponsesConfig) {
        if let Some(url) = &self.responses_redis_url {
            config.redis.get_or_insert_with(RedisConfig::default).url = url.clone();
        }
        if let Some(v) = self.responses_ttl_secs {
            config.ttl_secs = v;
        }
        if let Some(v) = self.responses_max_entries {
            config.max_entries = v;
        }
        if let Some(v) = &self.responses_key_file {
            config.key_file = Some(v.clone());
        }
    }
}

/// One stored response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stored {
    /// The response object as it was answered.
    pub response: Json,
    /// The input items of its request (`GET /v1/responses/{id}/input_items`).
    pub input: Vec<Json>,
    /// Every item of the conversation up to and including its output: what a request naming
    /// it as `previous_response_id` continues from.
    pub conversation: Vec<Json>,
    /// The API-key tenant that made it, the only one that may read it (none: an open gateway).
    pub owner: Option<String>,
}

/// Where stored responses live.
#[derive(Debug)]
pub enum ResponseStore {
    Memory(MemoryStore),
    Redis(RedisResponses),
}

impl ResponseStore {
    pub fn new(config: &ResponsesConfig) -> Result<Self, String> {
        let ttl = Duration::from_secs(config.ttl_secs);
        Ok(match &config.redis {
            None => {
                ResponseStore::Memory(MemoryStore::new(config.max_entries, config.max_bytes, ttl))
            }
            Some(redis) => ResponseStore::Redis(RedisResponses::connect(
                redis,
                &config.key_prefix,
                ttl,
                Duration::from_millis(config.store_timeout_ms),
            )?),
        })
    }

    pub async fn put(&self, id: &str, stored: &Stored) -> Result<(), ApiError> {
        match self {
            ResponseStore::Memory(m) => {
                m.put(id, stored.clone());
                Ok(())
            }
            ResponseStore::Redis(r) => r.put(id, stored).await,
        }
    }

    pub async fn get(&self, id: &str) -> Result<Option<Stored>, ApiError> {
        match self {
            ResponseStore::Memory(m) => Ok(m.get(id)),
            ResponseStore::Redis(r) => r.get(id).await,
        }
    }

    pub async fn delete(&self, id: &str) -> Result<bool, ApiError> {
        match self {
            ResponseStore::Memory(m) => Ok(m.delete(id)),
            ResponseStore::Redis(r) => r.delete(id).await,
        }
    }
}

/// Responses in this replica's memory: at most `max` of them and `max_bytes` of their JSON,
/// each for `ttl`.
#[derive(Debug)]
pub struct MemoryStore {
    max: usize,
    max_bytes: usize,
    ttl: Duration,
    inner: Mutex<Entries>,
}

#[derive(Debug, Default)]
struct Entries {
    /// Each response with when it was stored and its size.
    by_id: HashMap<String, (Instant, Stored, usize)>,
    /// Ids oldest first (a deleted id stays until it comes up and is skipped).
    order: VecDeque<String>,
    bytes: usize,
}

impl Entries {
    fn remove(&mut self, id: &str) -> Option<(Instant, Stored, usize)> {
        let removed = self.by_id.remove(id);
        if let Some((_, _, size)) = &removed {
            self.bytes -= size;
        }
        removed
    }
}

impl MemoryStore {
    pub fn new(max: usize, max_bytes: usize, ttl: Duration) -> Self {
        Self {
            max,
            max_bytes,
            ttl,
            inner: Mutex::new(Entries::default()),
        }
    }

    fn put(&self, id: &str, stored: Stored) {
        let size = serde_json::to_vec(&stored).map_or(0, |v| v.len());
        let mut e = self.inner.lock();
        // Ids are unique per response; one stored again keeps its place in the order.
        if e.remove(id).is_none() {
            e.order.push_back(id.to_owned());
        }
        e.by_id
            .insert(id.to_owned(), (Instant::now(), stored, size));
        e.bytes += size;
        while e.by_id.len() > self.max || e.bytes > self.max_bytes {
            let Some(oldest) = e.order.pop_front() else {
                break;
            };
            e.remove(&oldest);
        }
        // Ids deleted earlier are dropped from the order as they reach its front.
        while e.order.front().is_some_and(|id| !e.by_id.contains_key(id)) {
            e.order.pop_front();
        }
    }

    fn get(&self, id: &str) -> Option<Stored> {
        let mut e = self.inner.lock();
        match e.by_id.get(id) {
            Some((at, stored, _)) if at.elapsed() < self.ttl => Some(stored.clone()),
            Some(_) => {
                e.remove(id);
                None
            }
            None => None,
        }
    }

    fn delete(&self, id: &str) -> bool {
        let mut e = self.inner.lock();
        e.remove(id)
            .is_some_and(|(at, _, _)| at.elapsed() < self.ttl)
    }
}

/// Responses in Redis, one key each (`<prefix>:responses:<id>`) expiring with the TTL.
pub struct RedisResponses {
    connection: ConnectionManager,
    prefix: String,
    ttl: Duration,
}

impl std::fmt::Debug for RedisResponses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisResponses")
            .field("prefix", &self.prefix)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl RedisResponses {
    fn connect(
        config: &RedisConfig,
        prefix: &str,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Self, String> {
        let connection = crate::access::quota::redis_connection(config, timeout)
            .map_err(|e| format!("responses {}", e.0))?;
        Ok(Self {
            connection,
            prefix: format!("{prefix}:responses"),
            ttl,
        })
    }

    fn key(&self, id: &str) -> String {
        format!("{}:{id}", self.prefix)
    }

    async fn put(&self, id: &str, stored: &Stored) -> Result<(), ApiError> {
        let value = serde_json::to_string(stored)
            .map_err(|e| ApiError::Internal(format!("cannot store response {id}: {e}")))?;
        let ttl_ms = u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX);
        let mut connection = self.connection.clone();
        let options = redis::SetOptions::default().with_expiration(redis::SetExpiry::PX(ttl_ms));
        connection
            .set_options::<_, _, ()>(self.key(id), value, options)
            .await
            .map_err(unavailable)
    }

    async fn get(&self, id: &str) -> Result<Option<Stored>, ApiError> {
        let mut connection = self.connection.clone();
        let value: Option<String> = connection.get(self.key(id)).await.map_err(unavailable)?;
        value
            .map(|v| {
                serde_json::from_str(&v).map_err(|e| {
                    ApiError::Internal(format!("stored response {id} is unreadable: {e}"))
                })
            })
            .transpose()
    }

    async fn delete(&self, id: &str) -> Result<bool, ApiError> {
        let mut connection = self.connection.clone();
        let removed: u64 = connection.del(self.key(id)).await.map_err(unavailable)?;
        Ok(removed > 0)
    }
}

fn unavailable(e: redis::RedisError) -> ApiError {
    ApiError::Unavailable(format!("the response store (redis) did not answer: {e}"))
}

/// Seals reasoning text for a client to carry, and opens what it carries back.
pub struct Sealer {
    key: LessSafeKey,
    random: SystemRandom,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer")
    }
}

/// What a sealed text starts with: the scheme, so a later one can be told apart.
const SEALED_PREFIX: &str = "sy1.";
/// Bound to every sealed text: a sealed value means reasoning, nothing else.
const SEALED_AAD: &[u8] = b"switchyard responses reasoning v1";

impl Sealer {
    /// A key derived (HKDF-SHA256) from `secret`.
    pub fn from_secret(secret: &[u8]) -> Self {
        let salt = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"switchyard-responses");
        let prk = salt.extract(secret);
        let mut key = [0u8; 32];
        let filled = prk
            .expand(&[b"reasoning-seal-v1"], &CHACHA20_POLY1305)
            .and_then(|okm| okm.fill(&mut key));
        // HKDF-SHA256 always yields 32 bytes for a 32-byte algorithm; `fill` fails only on a
        // length mismatch, which this code cannot have.
        debug_assert!(filled.is_ok());
        Self::from_key(key)
    }

    /// A key made now: what it seals reads back only in this process.
    pub fn random() -> Self {
        let mut key = [0u8; 32];
        // The system's random source does not fail on a running Linux; if it did, the key
        // would be all zeroes and still seal (just not secretly): say so.
        if SystemRandom::new().fill(&mut key).is_err() {
            tracing::error!("no system randomness for the reasoning-sealing key");
        }
        Self::from_key(key)
    }

    fn from_key(key: [u8; 32]) -> Self {
        let unbound = UnboundKey::new(&CHACHA20_POLY1305, &key)
            .unwrap_or_else(|_| unreachable!("a 32-byte key fits ChaCha20-Poly1305"));
        Self {
            key: LessSafeKey::new(unbound),
            random: SystemRandom::new(),
        }
    }

    /// `text` sealed: `sy1.` then base64url of nonce, ciphertext and tag.
    pub fn seal(&self, text: &str) -> String {
        let mut nonce = [0u8; NONCE_LEN];
        if self.random.fill(&mut nonce).is_err() {
            tracing::error!("no system randomness for a sealing nonce");
        }
        let mut data = text.as_bytes().to_vec();
        let sealed = self.key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(SEALED_AAD),
            &mut data,
        );
        if sealed.is_err() {
            // Only a text over 256 GiB fails to seal.
            return String::new();
        }
        let mut out = nonce.to_vec();
        out.extend_from_slice(&data);
        format!(
            "{SEALED_PREFIX}{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(out)
        )
    }

    /// The text `sealed` holds, when this deployment sealed it and nobody changed it.
    pub fn open(&self, sealed: &str) -> Option<String> {
        let body = sealed.strip_prefix(SEALED_PREFIX)?;
        let mut bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .ok()?;
        if bytes.len() < NONCE_LEN {
            return None;
        }
        let mut data = bytes.split_off(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(&bytes).ok()?;
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(SEALED_AAD), &mut data)
            .ok()?;
        String::from_utf8(plain.to_vec()).ok()
    }
}

/// The stored responses and the reasoning sealer, shared by the handlers.
#[derive(Debug)]
pub struct ResponsesState {
    pub store: ResponseStore,
    pub sealer: Arc<Sealer>,
}

impl ResponsesState {
    /// The store `config` names; the sealing key from its key file, else the cluster secret
    /// (every replica of a cluster reads every other's sealed reasoning), else made now.
    pub fn new(config: &ResponsesConfig, cluster_secret: Option<&[u8]>) -> Result<Self, String> {
        let sealer = match (&config.key_file, cluster_secret) {
            (Some(path), _) => {
                let secret = std::fs::read(path).map_err(|e| {
                    format!("cannot read responses.key_file {}: {e}", path.display())
                })?;
                Sealer::from_secret(&secret)
            }
            (None, Some(secret)) => Sealer::from_secret(secret),
            (None, None) => Sealer::random(),
        };
        Ok(Self {
            store: ResponseStore::new(config)?,
            sealer: Arc::new(sealer),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(n: u64) -> Stored {
        Stored {
            response: json!({"id": n}),
            input: vec![json!({"type": "message"})],
            conversation: vec![],
            owner: None,
        }
    }

    #[test]
    fn memory_keeps_the_newest_within_the_bound_and_forgets_after_the_ttl() {
        let store = MemoryStore::new(2, 1 << 20, Duration::from_secs(60));
        store.put("a", stored(1));
        store.put("b", stored(2));
        store.put("c", stored(3));
        assert_eq!(store.get("a"), None, "the oldest went first");
        assert_eq!(store.get("c"), Some(stored(3)));
        assert!(store.delete("b"));
        assert!(!store.delete("b"));
        store.put("d", stored(4));
        assert_eq!(
            store.get("c"),
            Some(stored(3)),
            "a deleted id frees its place"
        );
        let expired = MemoryStore::new(2, 1 << 20, Duration::ZERO);
        expired.put("a", stored(1));
        assert_eq!(expired.get("a"), None);
        // The byte bound: a large conversation pushes the older responses out.
        let size = serde_json::to_vec(&stored(1)).unwrap().len();
        let small = MemoryStore::new(100, 3 * size, Duration::from_secs(60));
        for (i, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
            small.put(id, stored(i as u64 + 1));
        }
        assert_eq!(small.get("a"), None);
        assert!(small.get("b").is_some() && small.get("d").is_some());
    }

    #[test]
    fn sealed_reasoning_opens_with_the_same_key_only_and_not_once_changed() {
        let sealer = Sealer::from_secret(b"cluster secret");
        let sealed = sealer.seal("the user wants Paris");
        assert!(sealed.starts_with("sy1."));
        assert!(!sealed.contains("Paris"));
        assert_eq!(
            sealer.open(&sealed).as_deref(),
            Some("the user wants Paris")
        );
        // Another replica with the same secret reads it; another deployment does not.
        assert_eq!(
            Sealer::from_secret(b"cluster secret")
                .open(&sealed)
                .as_deref(),
            Some("the user wants Paris")
        );
        assert_eq!(Sealer::from_secret(b"other").open(&sealed), None);
        assert_eq!(Sealer::random().open(&sealed), None);
        // Two seals of one text differ (fresh nonces); a changed byte does not open.
        assert_ne!(sealer.seal("x"), sealer.seal("x"));
        let mut tampered = sealed.into_bytes();
        let last = tampered.len() - 1;
        tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
        assert_eq!(sealer.open(&String::from_utf8(tampered).unwrap()), None);
        assert_eq!(sealer.open("gAAAAAB-openai-sealed"), None);
        assert_eq!(sealer.open("sy1.!!"), None);
    }
}
