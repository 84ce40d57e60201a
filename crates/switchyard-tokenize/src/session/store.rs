//! The bounded set of live sessions: LRU by count and by bytes, plus an index from the
//! first bytes of a session's text to the session, to find a session when no id is given.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use switchyard_core::TokenId;

/// Texts shorter than this are not indexed by prefix (they tokenize in microseconds).
pub(crate) const HEAD_BYTES: usize = 256;
/// Sessions remembered per prefix: many sessions share a system prompt, and each candidate
/// costs a prefix comparison.
const CANDIDATES_PER_HEAD: usize = 8;
/// Bookkeeping per session beyond its text and token arrays (map entries, key, Arc).
const ENTRY_OVERHEAD_BYTES: usize = 160;

/// One session's last turn: its rendered text, token ids and each token's start byte.
#[derive(Debug)]
pub(crate) struct SessionState {
    pub text: String,
    pub ids: Vec<TokenId>,
    pub starts: Vec<u32>,
}

impl SessionState {
    fn bytes(&self, key: &str) -> usize {
        self.text.len()
            + key.len()
            + self.ids.len() * size_of::<TokenId>()
            + self.starts.len() * size_of::<u32>()
            + ENTRY_OVERHEAD_BYTES
    }
}

#[derive(Debug)]
struct Entry {
    state: Arc<SessionState>,
    tick: u64,
    head: Option<u64>,
    bytes: usize,
}

#[derive(Debug)]
pub(crate) struct SessionStore {
    entries: HashMap<String, Entry>,
    /// Last use → session, oldest first.
    lru: BTreeMap<u64, String>,
    /// Hash of the first [`HEAD_BYTES`] → sessions with that head, most recent last.
    by_head: HashMap<u64, Vec<String>>,
    tick: u64,
    bytes: usize,
    max_sessions: usize,
    max_bytes: usize,
    pub evictions: u64,
}

pub(crate) fn head_hash(text: &str) -> Option<u64> {
    let head = text.as_bytes().get(..HEAD_BYTES)?;
    let mut hasher = DefaultHasher::new();
    head.hash(&mut hasher);
    Some(hasher.finish())
}

impl SessionStore {
    pub(crate) fn new(max_sessions: usize, max_bytes: usize) -> Self {
        Self {
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            by_head: HashMap::new(),
            tick: 0,
            bytes: 0,
            max_sessions,
            max_bytes,
            evictions: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The session's state, marking it used.
    pub(crate) fn get(&mut self, key: &str) -> Option<Arc<SessionState>> {
        self.tick += 1;
        let entry = self.entries.get_mut(key)?;
        self.lru.remove(&entry.tick);
        entry.tick = self.tick;
        self.lru.insert(self.tick, key.to_owned());
        Some(Arc::clone(&entry.state))
    }

    /// Sessions whose text starts like `text` (same first [`HEAD_BYTES`]), most recent first.
    pub(crate) fn candidates(&self, text: &str) -> Vec<(String, Arc<SessionState>)> {
        let Some(keys) = head_hash(text).and_then(|h| self.by_head.get(&h)) else {
            return Vec::new();
        };
        keys.iter()
            .rev()
            .filter_map(|key| {
                let entry = self.entries.get(key)?;
                Some((key.clone(), Arc::clone(&entry.state)))
            })
            .collect()
    }

    /// Stores a session's new state, then evicts least recently used sessions until both
    /// bounds hold. A state larger than the byte cap on its own is not kept.
    pub(crate) fn insert(&mut self, key: String, state: Arc<SessionState>) {
        self.remove(&key);
        let bytes = state.bytes(&key);
        if bytes > self.max_bytes || self.max_sessions == 0 {
            return;
        }
        self.tick += 1;
        let head = head_hash(&state.text);
        if let Some(h) = head {
            let keys = self.by_head.entry(h).or_default();
            keys.retain(|k| *k != key);
            keys.push(key.clone());
            if keys.len() > CANDIDATES_PER_HEAD {
                keys.remove(0);
            }
        }
        self.lru.insert(self.tick, key.clone());
        self.bytes += bytes;
        self.entries.insert(
            key,
            Entry {
                state,
                tick: self.tick,
                head,
                bytes,
            },
        );
        while self.entries.len() > self.max_sessions || self.bytes > self.max_bytes {
            let Some((_, oldest)) = self.lru.pop_first() else {
                break;
            };
            self.remove(&oldest);
            self.evictions += 1;
        }
    }

    pub(crate) fn remove(&mut self, key: &str) -> bool {
        let Some(entry) = self.entries.remove(key) else {
            return false;
        };
        self.lru.remove(&entry.tick);
        self.bytes -= entry.bytes;
        if let Some(h) = entry.head
            && let Some(keys) = self.by_head.get_mut(&h)
        {
            keys.retain(|k| k != key);
            if keys.is_empty() {
                self.by_head.remove(&h);
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(text: &str) -> Arc<SessionState> {
        Arc::new(SessionState {
            text: text.to_owned(),
            ids: vec![1; text.len() / 4],
            starts: (0..text.len() as u32 / 4).map(|i| i * 4).collect(),
        })
    }

    #[test]
    fn evicts_least_recently_used_by_count() {
        let mut store = SessionStore::new(2, usize::MAX);
        store.insert("a".into(), state("aaaa"));
        store.insert("b".into(), state("bbbb"));
        assert!(store.get("a").is_some(), "a is now the most recent");
        store.insert("c".into(), state("cccc"));
        assert!(store.get("b").is_none(), "b was the least recently used");
        assert!(store.get("a").is_some() && store.get("c").is_some());
        assert_eq!((store.len(), store.evictions), (2, 1));
    }

    #[test]
    fn byte_cap_is_honoured_and_accounted() {
        let one = state(&"x".repeat(1000));
        let size = one.bytes("k0");
        let mut store = SessionStore::new(100, size * 3);
        for i in 0..10 {
            store.insert(format!("k{i}"), state(&"x".repeat(1000)));
            assert!(store.bytes() <= size * 3);
        }
        assert_eq!(store.len(), 3);
        assert_eq!(store.bytes(), size * 3);
        store.insert("huge".into(), state(&"y".repeat(10_000)));
        assert!(
            store.get("huge").is_none(),
            "larger than the cap on its own"
        );
        assert!(store.remove("k9") && !store.remove("k9"));
        assert_eq!(store.bytes(), size * 2);
    }

    #[test]
    fn finds_sessions_by_head() {
        let mut store = SessionStore::new(10, usize::MAX);
        let text = "h".repeat(HEAD_BYTES) + "tail";
        store.insert("a".into(), state(&text));
        store.insert("b".into(), state("short"));
        let found = store.candidates(&(text.clone() + " more"));
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0, "a");
        store.remove("a");
        assert!(store.candidates(&text).is_empty());
    }
}
