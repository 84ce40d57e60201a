//! Incremental tokenization by session: a coding agent resends its whole, growing history
//! every turn, so each turn is tokenized only from a little before where it stops agreeing
//! with the session's previous turn, and the old tokens before that are reused.
//!
//! - [`seam`]: where a seam can be cut so that the splice equals a full tokenization, and why.
//! - `hf_rules`: which seams a Hugging Face `tokenizer.json` allows.
//! - `store`: the bounded session set (LRU by count and bytes) and the prefix index that
//!   finds a session when the request names none.

pub(crate) mod hf_rules;
pub(crate) mod seam;
mod store;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use switchyard_core::TokenId;

use crate::error::TokenizeError;
use crate::parallel::{CoreBudget, ParallelPlan};
use crate::prefix::{PrefixCache, PrefixStats};
use crate::tokenizer::{Bounded, Tokenizer};
use seam::{SeamPolicy, common_prefix};
use store::{SessionState, SessionStore};

/// Bounds and checking of a [`SessionTokenizer`].
#[derive(Debug, Clone, PartialEq)]
pub struct SessionConfig {
    /// Sessions kept; the least recently used is dropped beyond this.
    pub max_sessions: usize,
    /// Bytes kept over all sessions (text, ids and offsets); LRU sessions are dropped beyond.
    pub max_bytes: usize,
    /// Fraction of incremental turns (0..=1) also tokenized in full and compared; on a
    /// mismatch the full result is used and the mismatch counted.
    pub verify_sample_rate: f64,
    /// Bytes of the cross-request prefix cache ([`PrefixCache`]) that serves turns with no
    /// earlier turn of their own; 0 turns it off.
    pub prefix_cache_bytes: usize,
}

/// Default bound of the prefix cache: room for a few hundred distinct system prompts and
/// tool lists (about 20 MB of text with its token ids and offsets).
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 64 << 20;

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            max_sessions: 1024,
            max_bytes: 512 << 20,
            verify_sample_rate: 0.01,
            prefix_cache_bytes: DEFAULT_PREFIX_CACHE_BYTES,
        }
    }
}

/// Counters of a [`SessionTokenizer`], for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Sessions held now.
    pub sessions: usize,
    /// Bytes held now (text, ids, offsets and bookkeeping).
    pub bytes: usize,
    /// Turns that reused tokens of an earlier turn.
    pub hits: u64,
    /// Turns tokenized in full (new session, nothing in common, or policy off).
    pub misses: u64,
    /// Incremental turns also tokenized in full to check them.
    pub verified: u64,
    /// Checks that found a difference (always 0 unless there is a bug).
    pub verify_mismatches: u64,
    /// Sessions dropped to honour the bounds.
    pub evictions: u64,
    /// Tokens reused over all turns, and bytes actually tokenized.
    pub reused_tokens: u64,
    pub tokenized_bytes: u64,
}

impl std::iter::Sum for SessionStats {
    /// Figures of several session tokenizers (one per tokenizer) added up.
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), |a, b| Self {
            sessions: a.sessions + b.sessions,
            bytes: a.bytes + b.bytes,
            hits: a.hits + b.hits,
            misses: a.misses + b.misses,
            verified: a.verified + b.verified,
            verify_mismatches: a.verify_mismatches + b.verify_mismatches,
            evictions: a.evictions + b.evictions,
            reused_tokens: a.reused_tokens + b.reused_tokens,
            tokenized_bytes: a.tokenized_bytes + b.tokenized_bytes,
        })
    }
}

/// The result of one turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionEncoding {
    pub token_ids: Vec<TokenId>,
    /// Tokens taken over from the session's previous turn (0 on a miss).
    pub reused_tokens: usize,
    /// Tokens taken from the cross-request prefix cache (0 when `reused_tokens` is not).
    pub prefix_tokens: usize,
    /// The session the turn was stored under (the given id, or one found or made).
    pub session: String,
}

/// Tokenizes turns of sessions incrementally. Blocking and CPU-bound like
/// [`Tokenizer::encode`]: call it from a blocking thread (as `Preprocessor` does). Shared
/// by reference across threads; the lock is held only to look up and store sessions.
#[derive(Debug)]
pub struct SessionTokenizer {
    tokenizer: Arc<Tokenizer>,
    config: SessionConfig,
    store: Mutex<SessionStore>,
    prefix: PrefixCache,
    turns: AtomicU64,
    anonymous: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    verified: AtomicU64,
    verify_mismatches: AtomicU64,
    reused_tokens: AtomicU64,
    tokenized_bytes: AtomicU64,
}

impl SessionTokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>, mut config: SessionConfig) -> Self {
        config.verify_sample_rate = if config.verify_sample_rate.is_nan() {
            0.0
        } else {
            config.verify_sample_rate.clamp(0.0, 1.0)
        };
        let store = SessionStore::new(config.max_sessions, config.max_bytes);
        let prefix = PrefixCache::new(&tokenizer, config.prefix_cache_bytes);
        Self {
            prefix,
            tokenizer,
            config,
            store: Mutex::new(store),
            turns: AtomicU64::new(0),
            anonymous: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            verified: AtomicU64::new(0),
            verify_mismatches: AtomicU64::new(0),
            reused_tokens: AtomicU64::new(0),
            tokenized_bytes: AtomicU64::new(0),
        }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// Whether this tokenizer allows incremental tokenization at all.
    pub fn is_incremental(&self) -> bool {
        self.tokenizer.seam_policy() != SeamPolicy::Disabled
    }

    /// Tokenizes `text`, a turn of `session_id` (or, when `None`, of the known session whose
    /// text it extends). Always equal to `tokenizer.encode(text)`.
    pub fn encode(
        &self,
        session_id: Option<&str>,
        text: &str,
    ) -> Result<Vec<TokenId>, TokenizeError> {
        Ok(self.encode_turn(session_id, text)?.token_ids)
    }

    /// [`encode`](Self::encode) with what was reused and where the turn was stored.
    pub fn encode_turn(
        &self,
        session_id: Option<&str>,
        text: &str,
    ) -> Result<SessionEncoding, TokenizeError> {
        self.encode_turn_within(session_id, text, usize::MAX)
    }

    /// [`encode_turn`](Self::encode_turn) for a turn that may have at most `max` tokens: a
    /// longer one fails with [`TokenizeError::TooManyTokens`] as early as
    /// [`Tokenizer::encode_within`] can tell, and leaves the session cache as it was.
    pub fn encode_turn_within(
        &self,
        session_id: Option<&str>,
        text: &str,
        max: usize,
    ) -> Result<SessionEncoding, TokenizeError> {
        if !self.is_incremental() {
            // Without seams there are no chunks (and no byte bound): the text is tokenized
            // whole, whether it fits or not.
            let token_ids = self.tokenizer.encode_within(text, max);
            if matches!(token_ids, Ok(_) | Err(TokenizeError::TooManyTokens { .. })) {
                self.count_tokenized(text.len());
            }
            let token_ids = token_ids?;
            self.misses.fetch_add(1, Ordering::Relaxed);
            return Ok(SessionEncoding {
                token_ids,
                reused_tokens: 0,
                prefix_tokens: 0,
                session: session_id.unwrap_or_default().to_owned(),
            });
        }
        let at_least = self.tokenizer.min_tokens(text.len());
        if at_least > max {
            return Err(TokenizeError::TooManyTokens { at_least, max });
        }
        let (base, found_key, own) = self.pick_base(session_id, text);
        let (ids, starts, reused, prefix_tokens) = match &base {
            Some(base) if own || !self.prefix.is_enabled() => {
                let (ids, starts, reused) = self.splice(base, text, max)?;
                (ids, starts, reused, 0)
            }
            other => self.encode_with_prefix(other.as_deref(), text, max)?,
        };
        let (ids, starts, reused, prefix_tokens) =
            if reused + prefix_tokens > 0 && self.sample_for_verification() {
                match self.verify(session_id, ids, starts, reused + prefix_tokens, text)? {
                    (ids, starts, 0) => (ids, starts, 0, 0),
                    (ids, starts, _) => (ids, starts, reused, prefix_tokens),
                }
            } else {
                (ids, starts, reused, prefix_tokens)
            };
        if reused > 0 {
            self.hits.fetch_add(1, Ordering::Relaxed);
            self.reused_tokens
                .fetch_add(reused as u64, Ordering::Relaxed);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        let key = match (session_id, found_key) {
            (Some(id), _) => id.to_owned(),
            (None, Some(key)) => key,
            (None, None) => format!(
                "anonymous-{}",
                self.anonymous.fetch_add(1, Ordering::Relaxed)
            ),
        };
        let state = Arc::new(SessionState {
            text: text.to_owned(),
            ids,
            starts,
        });
        let token_ids = state.ids.clone();
        self.lock().insert(key.clone(), state);
        Ok(SessionEncoding {
            token_ids,
            reused_tokens: reused,
            prefix_tokens,
            session: key,
        })
    }

    /// Forgets a session (e.g. when the client says it ended). Whether it was known.
    pub fn forget(&self, session_id: &str) -> bool {
        self.lock().remove(session_id)
    }

    pub fn stats(&self) -> SessionStats {
        let (sessions, bytes, evictions) = {
            let store = self.lock();
            (store.len(), store.bytes(), store.evictions)
        };
        SessionStats {
            sessions,
            bytes,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            verified: self.verified.load(Ordering::Relaxed),
            verify_mismatches: self.verify_mismatches.load(Ordering::Relaxed),
            evictions,
            reused_tokens: self.reused_tokens.load(Ordering::Relaxed),
            tokenized_bytes: self.tokenized_bytes.load(Ordering::Relaxed),
        }
    }

    /// Cross-request prefix cache counters, for metrics.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix.stats()
    }

    /// The state to start from: the named session's, unless it shares less than half of
    /// `text` and a session found by prefix shares more (a sub-agent reusing its parent's
    /// id, say). Also returns, for an unnamed turn, the found session it continues, and
    /// whether the state is the turn's own session's (else it is another session that only
    /// shares an opening with it, the prefix cache's business first).
    fn pick_base(
        &self,
        session_id: Option<&str>,
        text: &str,
    ) -> (Option<Arc<SessionState>>, Option<String>, bool) {
        let (named, candidates) = {
            let mut store = self.lock();
            let named = session_id.and_then(|id| store.get(id));
            let named_common = named
                .as_ref()
                .map_or(0, |s| common_prefix(s.text.as_bytes(), text.as_bytes()));
            if named_common * 2 >= text.len() && named.is_some() {
                return (named, None, true);
            }
            (named.map(|s| (named_common, s)), store.candidates(text))
        };
        // Prefix comparisons run without the lock.
        let best = candidates
            .into_iter()
            .map(|(key, state)| {
                let common = common_prefix(state.text.as_bytes(), text.as_bytes());
                (common, key, state)
            })
            .max_by_key(|(common, _, _)| *common);
        match (named, best) {
            (Some((named_common, named)), Some((common, _, state))) => {
                if common > named_common {
                    (Some(state), None, false)
                } else {
                    (Some(named), None, true)
                }
            }
            (Some((_, named)), None) => (Some(named), None, true),
            (None, Some((common, key, state))) => {
                // An unnamed turn continues the found session when it keeps most of it;
                // otherwise it starts a session of its own (that may branch off the found).
                let continues = session_id.is_none() && common * 2 >= state.text.len();
                (Some(state), continues.then_some(key), continues)
            }
            (None, None) => (None, None, false),
        }
    }

    /// Tokenizes a turn with no earlier turn of its own: its opening from the prefix cache,
    /// the rest fresh, and its new segments stored for the next prompt that shares them.
    /// `other` is another session's state sharing an opening with it: spliced from instead
    /// when it covers more than a chunk beyond what the cache holds.
    fn encode_with_prefix(
        &self,
        other: Option<&SessionState>,
        text: &str,
        max: usize,
    ) -> Result<(Vec<TokenId>, Vec<u32>, usize, usize), TokenizeError> {
        let cuts = self.prefix.cuts(text);
        let mut hit = self.prefix.lookup(text, &cuts);
        if let Some(other) = other {
            let common = common_prefix(other.text.as_bytes(), text.as_bytes());
            if common > hit.bytes + crate::prefix::CHUNK_BYTES {
                let (ids, starts, reused) = self.splice(other, text, max)?;
                return Ok((ids, starts, reused, 0));
            }
        }
        self.prefix.count(&hit);
        if hit.ids.len() > max {
            return Err(TokenizeError::TooManyTokens {
                at_least: hit.ids.len(),
                max,
            });
        }
        let reused = hit.ids.len();
        self.encode_tail(text, hit.bytes, &mut hit.ids, &mut hit.starts, max)?;
        self.prefix
            .insert(text, &cuts, hit.segments, &hit.ids, &hit.starts)?;
        Ok((hit.ids, hit.starts, 0, reused))
    }

    /// Re-tokenizes `text` from the restart point found against `base` and splices.
    fn splice(
        &self,
        base: &SessionState,
        text: &str,
        max: usize,
    ) -> Result<(Vec<TokenId>, Vec<u32>, usize), TokenizeError> {
        if base.text == text {
            if base.ids.len() > max {
                return Err(TokenizeError::TooManyTokens {
                    at_least: base.ids.len(),
                    max,
                });
            }
            return Ok((base.ids.clone(), base.starts.clone(), base.ids.len()));
        }
        let restart = self.tokenizer.seam_rules().find_restart(
            base.text.as_bytes(),
            &base.starts,
            &base.ids,
            text.as_bytes(),
        );
        let keep = restart.token;
        let mut ids = base.ids[..keep].to_vec();
        let mut starts = base.starts[..keep].to_vec();
        self.encode_tail(text, restart.byte, &mut ids, &mut starts, max)?;
        Ok((ids, starts, keep))
    }

    /// Appends the tokens of `text[from..]` (a clean split) to `ids` and `starts`, the tokens
    /// of `text[..from]`, refusing a total over `max`.
    fn encode_tail(
        &self,
        text: &str,
        from: usize,
        ids: &mut Vec<TokenId>,
        starts: &mut Vec<u32>,
        max: usize,
    ) -> Result<(), TokenizeError> {
        let Some(tail) = text.get(from..) else {
            return Err(TokenizeError::TextTooLong { bytes: text.len() });
        };
        let keep = ids.len();
        let encoded = self.encode_bounded(tail, max.saturating_sub(keep));
        self.count_tokenized(encoded.tokenized_bytes);
        let (tail_ids, tail_starts) = encoded.result.map_err(|err| match err {
            TokenizeError::TooManyTokens { at_least, .. } => TokenizeError::TooManyTokens {
                at_least: at_least + keep,
                max,
            },
            other => other,
        })?;
        let shift = crate::tokenizer::offset_u32(from)?;
        ids.extend_from_slice(&tail_ids);
        starts.reserve(tail_starts.len());
        for start in tail_starts {
            starts.push(
                start
                    .checked_add(shift)
                    .ok_or(TokenizeError::TextTooLong { bytes: text.len() })?,
            );
        }
        Ok(())
    }

    /// Tokenizes in full and compares; on a difference counts it, logs it and returns the
    /// full result.
    fn verify(
        &self,
        session_id: Option<&str>,
        ids: Vec<TokenId>,
        starts: Vec<u32>,
        reused: usize,
        text: &str,
    ) -> Result<(Vec<TokenId>, Vec<u32>, usize), TokenizeError> {
        self.verified.fetch_add(1, Ordering::Relaxed);
        let (full_ids, full_starts) = self.tokenizer.encode_with_starts(text)?;
        self.count_tokenized(text.len());
        if full_ids == ids {
            return Ok((ids, starts, reused));
        }
        self.verify_mismatches.fetch_add(1, Ordering::Relaxed);
        let first_difference = ids
            .iter()
            .zip(&full_ids)
            .position(|(a, b)| a != b)
            .unwrap_or(ids.len().min(full_ids.len()));
        tracing::warn!(
            session = session_id.unwrap_or("-"),
            tokenizer = self.tokenizer.name(),
            reused,
            first_difference,
            incremental_len = ids.len(),
            full_len = full_ids.len(),
            "incremental tokenization differs from full; using the full result"
        );
        Ok((full_ids, full_starts, 0))
    }

    /// Deterministic sampling: turn n is checked when n·rate crosses an integer.
    fn sample_for_verification(&self) -> bool {
        let rate = self.config.verify_sample_rate;
        if rate <= 0.0 {
            return false;
        }
        let n = self.turns.fetch_add(1, Ordering::Relaxed) as f64;
        ((n + 1.0) * rate).floor() > (n * rate).floor()
    }

    /// Tokenizes a fresh text or a turn's new tail: a long one in pieces on several cores.
    fn encode_bounded(&self, text: &str, max: usize) -> Bounded {
        crate::parallel::encode_with_starts_within(
            &self.tokenizer,
            text,
            max,
            &ParallelPlan::default(),
            CoreBudget::process(),
        )
    }

    fn count_tokenized(&self, bytes: usize) {
        self.tokenized_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, SessionStore> {
        // The store stays consistent across a panic elsewhere: every update is a few
        // statements without user code, so a poisoned lock is still usable.
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
