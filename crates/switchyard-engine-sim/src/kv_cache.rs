//! The paged KV cache: a device block pool with prefix caching and an optional host tier.
//!
//! Device blocks are reference counted. A full, computed block is *registered* under its chained
//! [`BlockHash`] so later prompts with the same prefix reuse it. When its last reference goes,
//! a registered block stays cached on an LRU list; an unregistered one (a partial tail) becomes
//! truly free. Allocation takes a truly free block first and otherwise evicts the least recently
//! released cached block, the way vLLM's free-block queue does.
//!
//! With a host tier, an evicted device block is demoted to host (its own LRU) instead of being
//! forgotten. A prefix hit on a host block *copies* it back to a device block: the host copy
//! stays, so the events are `Stored{Device}` only, and a later device eviction of that block
//! emits `Removed{Device}` without a second `Stored{Host}`.
//!
//! A retention hint pins a finished request's blocks until an expiry on the caller's clock
//! ([`KvCache::set_now`]): idle pinned blocks wait on their own list ([`Retained`]), bounded by
//! a budget, and are evicted only once no unpinned block is left, so a pin reorders eviction
//! and never blocks an allocation.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use switchyard_core::{BlockHash, SnapshotBlock, StorageTier, TokenId};

use crate::events::EventLog;
use crate::lru::LruQueue;
use crate::retained::{Pin, Placed, Retained, RetainedKey};

/// Index of a device block.
pub(crate) type BlockId = u32;

/// A registered device block's name; its tokens are in [`KvCache::block_tokens`].
#[derive(Debug, Clone, Copy)]
struct CachedBlock {
    hash: BlockHash,
    parent: Option<BlockHash>,
}

#[derive(Debug, Default)]
struct DeviceBlock {
    ref_count: u32,
    cached: Option<CachedBlock>,
    /// Position on the LRU list while cached, unreferenced and not pinned.
    lru_tick: Option<u64>,
    /// The strongest retention pin a finished request put on it (possibly expired).
    pin: Option<Pin>,
    /// Position on the pinned list while cached, unreferenced and pinned.
    retained_key: Option<RetainedKey>,
}

#[derive(Debug)]
struct HostBlock {
    parent: Option<BlockHash>,
    tokens: Vec<TokenId>,
    /// `None` while pinned by an admission that is copying it back.
    lru_tick: Option<u64>,
}

/// Where each leading block of a prompt was found.
pub(crate) type PrefixHit = Vec<StorageTier>;

#[derive(Debug)]
pub(crate) struct KvCache {
    blocks: Vec<DeviceBlock>,
    block_size: usize,
    /// The tokens of device block `b` at `b * block_size ..`, valid while it is registered:
    /// one slab rather than a vector per block (allocating and freeing those was a good part
    /// of a replay's time).
    block_tokens: Vec<TokenId>,
    /// Truly free blocks, popped from the back so block 0 is used first.
    free: Vec<BlockId>,
    /// Cached, unreferenced blocks by release order; the smallest tick is evicted first.
    lru: LruQueue,
    /// Block hashes are XXH3 outputs already: FxHash only spreads them (SipHash cost a tenth
    /// of a replay).
    by_hash: FxHashMap<BlockHash, BlockId>,
    host_capacity: usize,
    host: FxHashMap<BlockHash, HostBlock>,
    host_lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    retained: Retained,
    /// The caller's clock, in microseconds: pins expire against it.
    now_us: u64,
}

impl KvCache {
    pub(crate) fn new(
        device_blocks: u32,
        block_size: usize,
        host_blocks: u64,
        retention_budget: usize,
    ) -> Self {
        Self {
            blocks: (0..device_blocks).map(|_| DeviceBlock::default()).collect(),
            block_size,
            block_tokens: Vec::new(),
            free: (0..device_blocks).rev().collect(),
            lru: LruQueue::new(),
            by_hash: FxHashMap::default(),
            host_capacity: usize::try_from(host_blocks).unwrap_or(usize::MAX),
            host: FxHashMap::default(),
            host_lru: BTreeMap::new(),
            tick: 0,
            retained: Retained::new(retention_budget),
            now_us: 0,
        }
    }

    /// Moves the clock pins expire against (never backwards).
    pub(crate) fn set_now(&mut self, now_us: u64) {
        self.now_us = self.now_us.max(now_us);
    }

    pub(crate) fn now_us(&self) -> u64 {
        self.now_us
    }

    /// Idle blocks pinned by a retention hint now.
    pub(crate) fn retained_blocks(&self) -> usize {
        self.retained.len()
    }

    /// Pins the registered blocks of `table` (a finished request's) with `pin`; they take the
    /// pinned list when their last reference goes.
    pub(crate) fn pin(&mut self, table: &[BlockId], pin: Pin) {
        for &block in table {
            let b = &mut self.blocks[block as usize];
            if b.cached.is_some() {
                b.pin = Some(b.pin.map_or(pin, |old| old.merge(pin)));
            }
        }
    }

    /// Puts blocks whose pin expired back on the LRU list, at their release position.
    fn expire_pins(&mut self) {
        for (tick, block) in self.retained.expire(self.now_us) {
            let b = &mut self.blocks[block as usize];
            b.retained_key = None;
            b.lru_tick = Some(tick);
            self.lru.insert(tick, block);
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    pub(crate) fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks an allocation could obtain: truly free plus evictable (pinned ones included).
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.lru.len() + self.retained.len()
    }

    /// Blocks with at least one reference.
    pub(crate) fn active_blocks(&self) -> usize {
        self.capacity() - self.available()
    }

    /// Blocks holding data: referenced or cached.
    pub(crate) fn used_blocks(&self) -> usize {
        self.capacity() - self.free.len()
    }

    /// The longest run of leading `hashes` cached in either tier, at most `max_blocks` long.
    pub(crate) fn lookup_prefix(&self, hashes: &[BlockHash], max_blocks: usize) -> PrefixHit {
        hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| {
                if self.by_hash.contains_key(h) {
                    Some(StorageTier::Device)
                } else if self.host.contains_key(h) {
                    Some(StorageTier::Host)
                } else {
                    None
                }
            })
            .collect()
    }

    /// How many leading `hashes` (at most `max_blocks`) are cached in either tier: the length
    /// of [`Self::lookup_prefix`]'s hit, without building it.
    pub(crate) fn cached_prefix_len(&self, hashes: &[BlockHash], max_blocks: usize) -> usize {
        hashes
            .iter()
            .take(max_blocks)
            .take_while(|h| self.by_hash.contains_key(h) || self.host.contains_key(h))
            .count()
    }

    /// Whether [`Self::admit`] can take a reference on the hit and allocate `extra` blocks.
    pub(crate) fn can_admit(&self, hashes: &[BlockHash], hit: &PrefixHit, extra: usize) -> bool {
        let mut needed = extra;
        let mut reclaimed_from_lru = 0;
        for (hash, tier) in hashes.iter().zip(hit) {
            match tier {
                StorageTier::Device => {
                    let idle = self
                        .by_hash
                        .get(hash)
                        .is_some_and(|&b| self.blocks[b as usize].ref_count == 0);
                    if idle {
                        reclaimed_from_lru += 1;
                    }
                }
                _ => needed += 1,
            }
        }
        needed <= self.available().saturating_sub(reclaimed_from_lru)
    }

    /// References the hit's device blocks, copies its host blocks back to the device and
    /// allocates `extra` fresh blocks, returning the block table in order. Call only after
    /// [`Self::can_admit`] said yes; returns `None` (having changed nothing) otherwise.
    pub(crate) fn admit(
        &mut self,
        hashes: &[BlockHash],
        hit: &PrefixHit,
        extra: usize,
        events: &mut EventLog,
    ) -> Option<Vec<BlockId>> {
        if !self.can_admit(hashes, hit, extra) {
            return None;
        }
        let mut table = Vec::with_capacity(hit.len() + extra);
        let mut host_hits = Vec::new();
        for (hash, tier) in hashes.iter().zip(hit) {
            match self.by_hash.get(hash).copied() {
                Some(block) if *tier == StorageTier::Device => {
                    self.take_ref(block);
                    table.push(block);
                }
                _ => {
                    // Pinned so demotions made room for below cannot evict what we copy.
                    if let Some(hb) = self.host.get_mut(hash)
                        && let Some(tick) = hb.lru_tick.take()
                    {
                        self.host_lru.remove(&tick);
                    }
                    host_hits.push((table.len(), *hash));
                    table.push(BlockId::MAX);
                }
            }
        }
        let fresh = self.allocate(host_hits.len() + extra, events)?;
        let mut fresh = fresh.into_iter();
        for (slot, hash) in host_hits {
            let block = fresh.next()?;
            let tick = self.next_tick();
            let hb = self.host.get_mut(&hash)?;
            hb.lru_tick = Some(tick);
            let parent = hb.parent;
            events.stored(StorageTier::Device, parent, hash, hb.tokens.clone());
            if let Some(slot) = slab_slot(&mut self.block_tokens, block, self.block_size) {
                copy_tokens(slot, &hb.tokens);
            }
            self.host_lru.insert(tick, hash);
            self.blocks[block as usize].cached = Some(CachedBlock { hash, parent });
            self.by_hash.insert(hash, block);
            table[slot] = block;
        }
        table.extend(fresh);
        Some(table)
    }

    /// The device block caching `hash`, if any.
    pub(crate) fn cached_device_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.by_hash.get(&hash).copied()
    }

    /// Takes one reference on a cached block (off the LRU list while referenced).
    pub(crate) fn reference(&mut self, block: BlockId) {
        self.take_ref(block);
    }

    fn take_ref(&mut self, block: BlockId) {
        let b = &mut self.blocks[block as usize];
        if let Some(tick) = b.lru_tick.take() {
            self.lru.remove(tick, block);
        }
        if let Some(key) = b.retained_key.take() {
            self.retained.take(key);
        }
        b.ref_count += 1;
    }

    /// `n` fresh, referenced, unregistered blocks, evicting cached ones as needed; `None`
    /// (having changed nothing) when fewer than `n` can be had.
    pub(crate) fn allocate(&mut self, n: usize, events: &mut EventLog) -> Option<Vec<BlockId>> {
        if n > self.available() {
            return None;
        }
        if n > self.free.len() {
            // Expired pins compete on plain recency again before anything is evicted.
            self.expire_pins();
        }
        let mut out = Vec::with_capacity(n);
        let mut evicted = Vec::new();
        for _ in 0..n {
            let block = match self.free.pop() {
                Some(b) => b,
                None => {
                    // Unpinned victims first; pinned ones only when none is left.
                    let b = match self.lru.pop_first() {
                        Some((_, b)) => b,
                        None => self.retained.pop_weakest()?.1,
                    };
                    let slot = &mut self.blocks[b as usize];
                    slot.lru_tick = None;
                    slot.retained_key = None;
                    slot.pin = None;
                    if let Some(cached) = slot.cached.take() {
                        self.by_hash.remove(&cached.hash);
                        events.removed(StorageTier::Device, cached.hash);
                        evicted.push((b, cached));
                    }
                    b
                }
            };
            self.blocks[block as usize].ref_count = 1;
            out.push(block);
        }
        // After all the device removals, so a burst of evictions stays one event; parents
        // first (victims come tail-first off the LRU list) so no host block names a parent
        // the host tier has not announced yet.
        // Nothing has written to the victims' token slots yet: they still hold their tokens.
        for (block, cached) in evicted.into_iter().rev() {
            self.demote(block, cached, events);
        }
        Some(out)
    }

    fn demote(&mut self, block: BlockId, cached: CachedBlock, events: &mut EventLog) {
        if self.host_capacity == 0 {
            return;
        }
        let tick = self.next_tick();
        if let Some(hb) = self.host.get_mut(&cached.hash) {
            // Already on host (it came from there): only refresh its recency.
            if let Some(old) = hb.lru_tick.replace(tick) {
                self.host_lru.remove(&old);
            }
            self.host_lru.insert(tick, cached.hash);
            return;
        }
        if self.host.len() >= self.host_capacity {
            let Some((_, victim)) = self.host_lru.pop_first() else {
                return; // everything on host is pinned: drop the block instead
            };
            self.host.remove(&victim);
            events.removed(StorageTier::Host, victim);
        }
        let tokens = self.tokens_of(block).to_vec();
        events.stored(
            StorageTier::Host,
            cached.parent,
            cached.hash,
            tokens.clone(),
        );
        self.host.insert(
            cached.hash,
            HostBlock {
                parent: cached.parent,
                tokens,
                lru_tick: Some(tick),
            },
        );
        self.host_lru.insert(tick, cached.hash);
    }

    /// Registers a just-computed full block under `hash` and returns the block the sequence
    /// should keep: its own, or the already-cached twin (its own is then freed, as another
    /// sequence computed the same prefix first). Emits `Stored` only for a new entry.
    pub(crate) fn register(
        &mut self,
        block: BlockId,
        parent: Option<BlockHash>,
        hash: BlockHash,
        tokens: &[TokenId],
        events: &mut EventLog,
    ) -> BlockId {
        if let Some(&twin) = self.by_hash.get(&hash) {
            if twin != block {
                self.take_ref(twin);
                self.release(&[block]);
            }
            return twin;
        }
        events.stored(StorageTier::Device, parent, hash, tokens.to_vec());
        if let Some(slot) = slab_slot(&mut self.block_tokens, block, self.block_size) {
            copy_tokens(slot, tokens);
        }
        self.blocks[block as usize].cached = Some(CachedBlock { hash, parent });
        self.by_hash.insert(hash, block);
        block
    }

    /// Drops one reference on each block. The last block of a sequence goes on the LRU list
    /// first, so eviction eats prefixes from their tails, keeping the cache a set of prefixes.
    pub(crate) fn release(&mut self, table: &[BlockId]) {
        for &block in table.iter().rev() {
            let b = &mut self.blocks[block as usize];
            b.ref_count = b.ref_count.saturating_sub(1);
            if b.ref_count > 0 {
                continue;
            }
            if b.cached.is_some() {
                let pin = b.pin;
                let tick = self.next_tick();
                let placed = match pin {
                    Some(pin) => self.retained.insert(block, pin, tick, self.now_us),
                    None => Placed::Unpinned,
                };
                match placed {
                    Placed::Pinned(displaced) => {
                        self.blocks[block as usize].retained_key =
                            pin.map(|p| (p.priority, p.expiry_us, tick));
                        if let Some((old_tick, old)) = displaced {
                            let o = &mut self.blocks[old as usize];
                            o.retained_key = None;
                            o.lru_tick = Some(old_tick);
                            self.lru.insert(old_tick, old);
                        }
                    }
                    Placed::Unpinned => {
                        self.blocks[block as usize].lru_tick = Some(tick);
                        self.lru.insert(tick, block);
                    }
                }
            } else {
                self.free.push(block);
            }
        }
    }

    /// Hash and tokens of a registered block.
    pub(crate) fn block_content(&self, block: BlockId) -> Option<(BlockHash, Vec<TokenId>)> {
        let cached = self.blocks.get(block as usize)?.cached.as_ref()?;
        Some((cached.hash, self.tokens_of(block).to_vec()))
    }

    /// The token slot of device block `block` (its tokens while it is registered).
    fn tokens_of(&self, block: BlockId) -> &[TokenId] {
        let start = block as usize * self.block_size;
        self.block_tokens
            .get(start..start + self.block_size)
            .unwrap_or_default()
    }

    /// Every cached block of both tiers, device first, each tier ordered by hash.
    pub(crate) fn snapshot(&self) -> Vec<SnapshotBlock> {
        let mut out: Vec<SnapshotBlock> = self
            .blocks
            .iter()
            .filter_map(|b| b.cached.as_ref())
            .map(|c| SnapshotBlock {
                hash: c.hash,
                parent: c.parent,
                tier: StorageTier::Device,
            })
            .chain(self.host.iter().map(|(hash, hb)| SnapshotBlock {
                hash: *hash,
                parent: hb.parent,
                tier: StorageTier::Host,
            }))
            .collect();
        out.sort_by_key(|b| (b.tier, b.hash));
        out
    }
}

/// The token slot of device block `block` in `slab`, which grows to hold it (blocks are
/// handed out lowest first, so the slab grows with the cache's use, as the per-block vectors
/// it replaces did).
fn slab_slot(slab: &mut Vec<TokenId>, block: BlockId, block_size: usize) -> Option<&mut [TokenId]> {
    let start = block as usize * block_size;
    let end = start + block_size;
    if slab.len() < end {
        slab.resize(end, 0);
    }
    slab.get_mut(start..end)
}

/// Copies a block's tokens into its slot (callers pass full blocks, which fill it exactly).
fn copy_tokens(slot: &mut [TokenId], tokens: &[TokenId]) {
    debug_assert_eq!(slot.len(), tokens.len(), "a block is block_size tokens");
    for (to, &from) in slot.iter_mut().zip(tokens) {
        *to = from;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::chain_hash;

    fn block(parent: Option<BlockHash>, t: u32) -> (BlockHash, Vec<TokenId>) {
        let tokens = vec![t, t + 1];
        (chain_hash(parent, &tokens), tokens)
    }

    /// Allocates and registers one block per token seed as a chain, then releases it.
    fn cache_chain(kv: &mut KvCache, seeds: &[u32], events: &mut EventLog) -> Vec<BlockHash> {
        let table = kv.allocate(seeds.len(), events).unwrap();
        let mut parent = None;
        let mut hashes = Vec::new();
        for (&b, &s) in table.iter().zip(seeds) {
            let (h, t) = block(parent, s);
            kv.register(b, parent, h, &t, events);
            hashes.push(h);
            parent = Some(h);
        }
        kv.release(&table);
        hashes
    }

    #[test]
    fn eviction_takes_free_blocks_first_then_lru_tails() {
        let mut kv = KvCache::new(4, 2, 0, 0);
        let mut ev = EventLog::default();
        let hs = cache_chain(&mut kv, &[10, 20, 30], &mut ev);
        assert_eq!(kv.used_blocks(), 3);
        assert_eq!(kv.active_blocks(), 0);
        let mut ev = EventLog::default();
        let got = kv.allocate(2, &mut ev).unwrap();
        assert_eq!(got.len(), 2);
        // One truly free block, then the chain's tail.
        assert_eq!(
            ev.into_events(),
            vec![switchyard_core::KvEvent::Removed {
                blocks: vec![hs[2]],
                tier: StorageTier::Device
            }]
        );
        assert!(kv.allocate(3, &mut EventLog::default()).is_none());
    }

    #[test]
    fn a_twin_block_is_shared_not_stored_twice() {
        let mut kv = KvCache::new(4, 2, 0, 0);
        let mut ev = EventLog::default();
        let t = kv.allocate(2, &mut ev).unwrap();
        let (h, tokens) = block(None, 1);
        assert_eq!(kv.register(t[0], None, h, &tokens, &mut ev), t[0]);
        assert_eq!(kv.register(t[1], None, h, &tokens, &mut ev), t[0]);
        assert_eq!(ev.into_events().len(), 1);
        assert_eq!(kv.active_blocks(), 1);
        kv.release(&[t[0], t[0]]);
        assert_eq!(kv.active_blocks(), 0);
        assert_eq!(kv.snapshot().len(), 1);
    }
}
