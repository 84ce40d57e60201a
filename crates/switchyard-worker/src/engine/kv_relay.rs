//! Turning decoded engine batches into Switchyard [`KvEvent`]s in the worker's [`EventLog`],
//! with exact block accounting.
//!
//! What the engine holds is a set of (KV-cache group, engine block hash, medium) entries, and
//! engines say the same thing more than once: vLLM re-announces cached blocks
//! (`kv_cache_report_mode = "full"`), publishes one store and one removal per KV-cache group of
//! a hybrid model (with the same hash value in several groups), and its offloading connector
//! repeats shared hashes. So each rank keeps one [`EngineHashMap`] per group, a store of an entry
//! the map already holds is a no-op (counted as a duplicate), a removal drops only an entry that
//! is held (an unknown one is counted and harmless), and a block of ours is held by a rank while
//! at least one of its entries maps to it. Each data-parallel rank is its own engine-hash
//! namespace, but all ranks publish into the worker's one event log: a block is announced removed
//! only when the last rank drops it, and a rank that restarts or loses events removes only the
//! blocks no other rank still holds.
//!
//! Only events the worker's index can use are relayed: blocks of the worker's block size (a
//! smaller one is a partial page; a larger one is reported, naming both sizes), of full-attention
//! KV-cache groups (vLLM's sliding-window or Mamba groups do not name prefixes), in a medium
//! mapped to a tier explicitly (`GPU` device; `CPU`, `CPU_PINNED` host; `DISK`, `STORAGE` disk;
//! `EXTERNAL` — SGLang's shared/remote pool — and any medium not known here, the remote tier,
//! the unknown ones counted and reported).

use std::collections::{BTreeMap, HashMap, HashSet};

use switchyard_core::{BlockHash, BlockSize, KvEvent, StorageTier};
use switchyard_router::EngineHashMap;

use super::kv_decode::{EngineBatch, EngineEvent, StoredEvent};
use super::stats::{AdapterCounters, RankCounters};
use crate::event_log::EventLog;

type BlockKey = (BlockHash, StorageTier);

/// One rank's view: its per-group hash maps and how many of its engine entries map to each of
/// our blocks.
#[derive(Debug, Default)]
struct RankView {
    groups: BTreeMap<u32, EngineHashMap>,
    held: HashMap<BlockKey, u32>,
    /// A block-size mismatch was reported already (then only counted).
    reported_block_size: bool,
    /// Media reported once as unknown.
    reported_media: HashSet<String>,
}

/// The relay of one worker: every rank's view and the cross-rank hold counts.
#[derive(Debug)]
pub struct KvRelay {
    block_size: BlockSize,
    map_capacity: usize,
    ranks: Vec<RankView>,
    /// Number of ranks holding each block.
    holders: HashMap<BlockKey, u32>,
}

impl KvRelay {
    pub fn new(block_size: BlockSize, dp_ranks: u32, map_capacity: usize) -> Self {
        Self {
            block_size,
            map_capacity,
            ranks: (0..dp_ranks.max(1)).map(|_| RankView::default()).collect(),
            holders: HashMap::new(),
        }
    }

    /// Blocks (per tier) that at least one rank holds.
    pub fn block_count(&self) -> usize {
        self.holders.len()
    }

    /// Every (block, tier) at least one rank holds, sorted (for tests comparing with an
    /// engine's true set).
    pub fn held_blocks(&self) -> Vec<(BlockHash, StorageTier)> {
        let mut out: Vec<_> = self.holders.keys().copied().collect();
        out.sort();
        out
    }

    /// Applies one engine batch from `rank` and publishes the resulting events.
    pub fn apply(&mut self, rank: u32, batch: &EngineBatch, log: &EventLog, c: &AdapterCounters) {
        let c = c.rank(rank);
        for skipped in &batch.skipped {
            c.add(&c.skipped_events, 1);
            tracing::warn!(rank, event = %skipped.kind, why = %skipped.why, "engine kv event skipped; the rest of its batch is kept");
        }
        let mut out = Vec::new();
        for event in &batch.events {
            match event {
                EngineEvent::BlockStored(stored) => self.stored(rank, stored, c, &mut out),
                EngineEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    group,
                } => {
                    let tier = self.tier(rank, medium.as_deref(), c);
                    if let Some(ev) = self.removed(rank, *group, block_hashes, tier, c) {
                        out.push(ev);
                    }
                }
                EngineEvent::AllBlocksCleared => out.extend(self.reset_rank(rank)),
            }
        }
        c.add(&c.events, batch.events.len() as u64);
        if !out.is_empty() {
            log.publish(out);
        }
    }

    /// Forgets everything `rank` held (engine restart, unrepairable gap, cache reset) and
    /// publishes what that removes from the worker's view.
    pub fn reset_and_publish(&mut self, rank: u32, log: &EventLog) {
        let events = self.reset_rank(rank);
        if !events.is_empty() {
            log.publish(events);
        }
    }

    fn rank(&mut self, rank: u32) -> Option<&mut RankView> {
        self.ranks.get_mut(rank as usize)
    }

    /// The tier an engine medium names (see the module docs); an unknown medium is reported
    /// once per rank and counted every time.
    fn tier(&mut self, rank: u32, medium: Option<&str>, c: &RankCounters) -> StorageTier {
        let (tier, known) = tier(medium);
        if !known {
            c.add(&c.unknown_media, 1);
            let name = medium.unwrap_or_default().to_owned();
            if let Some(view) = self.rank(rank)
                && view.reported_media.insert(name.clone())
            {
                tracing::warn!(rank, medium = %name, "engine kv events name a medium this worker does not know; its blocks count as a non-device tier");
            }
        }
        tier
    }

    /// Relays one engine store: the Switchyard `Stored` of its full blocks, after the `Removed`
    /// of whatever blocks the engine hashes it reuses named before.
    fn stored(&mut self, rank: u32, e: &StoredEvent, c: &RankCounters, out: &mut Vec<KvEvent>) {
        if e.spec_kind.as_deref().is_some_and(|k| !k.contains("full")) {
            // A sliding-window or Mamba group's blocks do not name a reusable prefix.
            c.add(&c.other_groups, 1);
            return;
        }
        let ours = self.block_size.get();
        match e.block_size {
            Some(theirs) if theirs < ours => {
                // A partial page (SGLang's last page, vLLM's partial prefix entries).
                c.add(&c.partial_blocks, e.block_hashes.len() as u64);
                return;
            }
            Some(theirs) if theirs > ours => {
                c.add(&c.block_size_mismatches, 1);
                if let Some(view) = self.rank(rank)
                    && !view.reported_block_size
                {
                    view.reported_block_size = true;
                    tracing::error!(
                        rank,
                        engine_block_size = theirs,
                        worker_block_size = ours,
                        "the engine announces blocks of {theirs} tokens but this worker's block size is {ours}; \
                         those events are skipped (set the worker's block size to the engine's KV event block size)"
                    );
                }
                return;
            }
            _ => {}
        }
        let tier = self.tier(rank, e.medium.as_deref(), c);
        let bs = self.block_size.as_usize();
        // Only full blocks have keys: a page beyond the tokens is skipped.
        let full = e.block_hashes.len().min(e.token_ids.len() / bs);
        if full < e.block_hashes.len() {
            c.add(&c.partial_blocks, (e.block_hashes.len() - full) as u64);
        }
        if full == 0 {
            return;
        }
        let (block_size, capacity) = (self.block_size, self.map_capacity);
        let hashes = &e.block_hashes[..full];
        let tokens = &e.token_ids[..full * bs];
        let keys = if e.block_keys.is_empty() {
            &[][..]
        } else {
            &e.block_keys[..full.min(e.block_keys.len())]
        };
        let Some(view) = self.rank(rank) else {
            return;
        };
        let map = view
            .groups
            .entry(e.group)
            .or_insert_with(|| EngineHashMap::new(block_size, capacity));
        let fresh = match map.rehash(e.parent, hashes, tokens, keys) {
            Ok((_, fresh)) => fresh,
            Err(err) => {
                // The parent was never seen (we joined late or lost it): the chain cannot be
                // rehashed; those blocks stay unknown until the engine stores them afresh.
                c.add(&c.unrelatable, 1);
                tracing::debug!(rank, error = %err, "engine BlockStored skipped");
                return;
            }
        };
        // An engine hash the map holds for another block now names other tokens. A correct
        // engine never does that (its hash is of the tokens), but a wrong one must not leave the
        // old block announced for ever: it is removed from every tier first, as the engine's own
        // removal would have, so the log and the relay keep holding the same blocks.
        let reused: Vec<(u64, StorageTier)> = hashes
            .iter()
            .zip(&fresh)
            .filter(|(h, new)| map.get(**h).is_some_and(|old| old != **new))
            .flat_map(|(h, _)| {
                StorageTier::ALL
                    .into_iter()
                    .filter(|t| map.holds(*h, *t))
                    .map(|t| (*h, t))
            })
            .collect();
        for (engine_hash, old_tier) in reused {
            out.extend(self.removed(rank, e.group, &[engine_hash], old_tier, c));
        }
        let Some(view) = self.rank(rank) else {
            return;
        };
        let Some(map) = view.groups.get_mut(&e.group) else {
            return;
        };
        let already: Vec<bool> = hashes.iter().map(|h| map.holds(*h, tier)).collect();
        let event = match map.stored_keyed(e.parent, hashes, tokens, keys, tier) {
            Ok(event) => event,
            Err(err) => {
                // As above; also a parent the same event reuses, which its removal forgot.
                c.add(&c.unrelatable, 1);
                tracing::debug!(rank, error = %err, "engine BlockStored skipped");
                return;
            }
        };
        let KvEvent::Stored { blocks, .. } = &event else {
            out.push(event);
            return;
        };
        let mut newly = Vec::new();
        for (block, was_held) in blocks.iter().zip(already) {
            if was_held {
                // A re-announcement of an entry the engine already holds: nothing changes.
                c.add(&c.duplicate_stores, 1);
                continue;
            }
            let count = view.held.entry((block.hash, tier)).or_insert(0);
            *count += 1;
            if *count == 1 {
                newly.push((block.hash, tier));
            }
        }
        for key in newly {
            *self.holders.entry(key).or_insert(0) += 1;
        }
        out.push(event);
    }

    fn removed(
        &mut self,
        rank: u32,
        group: u32,
        hashes: &[u64],
        tier: StorageTier,
        c: &RankCounters,
    ) -> Option<KvEvent> {
        let view = self.rank(rank)?;
        let Some(map) = view.groups.get_mut(&group) else {
            c.add(&c.unknown_removals, hashes.len() as u64);
            return None;
        };
        let unknown_before = map.unknown_removed();
        let KvEvent::Removed { blocks, tier } = map.removed(hashes, tier) else {
            return None;
        };
        c.add(&c.unknown_removals, map.unknown_removed() - unknown_before);
        let mut gone = Vec::new();
        for hash in blocks {
            let key = (hash, tier);
            if let Some(count) = view.held.get_mut(&key) {
                *count -= 1;
                if *count == 0 {
                    view.held.remove(&key);
                    gone.push(key);
                }
            }
        }
        let mut removed = Vec::new();
        for key in gone {
            if let Some(holders) = self.holders.get_mut(&key) {
                *holders -= 1;
                if *holders == 0 {
                    self.holders.remove(&key);
                    removed.push(key.0);
                }
            }
        }
        (!removed.is_empty()).then_some(KvEvent::Removed {
            blocks: removed,
            tier,
        })
    }

    fn reset_rank(&mut self, rank: u32) -> Vec<KvEvent> {
        let Some(view) = self.rank(rank) else {
            return Vec::new();
        };
        let held: Vec<BlockKey> = view.held.drain().map(|(k, _)| k).collect();
        view.groups.clear();
        let mut gone: HashMap<StorageTier, Vec<BlockHash>> = HashMap::new();
        for key in held {
            if let Some(holders) = self.holders.get_mut(&key) {
                *holders -= 1;
                if *holders == 0 {
                    self.holders.remove(&key);
                    gone.entry(key.1).or_default().push(key.0);
                }
            }
        }
        if self.holders.is_empty() {
            // Nothing is left anywhere: say so in one event, which also clears anything a
            // consumer might still hold from before.
            return vec![KvEvent::Cleared];
        }
        let tiers: HashSet<StorageTier> = gone.keys().copied().collect();
        StorageTier::ALL
            .into_iter()
            .filter(|t| tiers.contains(t))
            .filter_map(|t| gone.remove(&t).map(|blocks| (t, blocks)))
            .map(|(tier, mut blocks)| {
                blocks.sort();
                KvEvent::Removed { blocks, tier }
            })
            .collect()
    }
}

/// The tier an engine medium names, and whether the medium is one this worker knows. Absent
/// means the device (older engines send none).
pub fn tier(medium: Option<&str>) -> (StorageTier, bool) {
    let Some(medium) = medium else {
        return (StorageTier::Device, true);
    };
    match medium.to_ascii_uppercase().as_str() {
        "GPU" | "DEVICE" | "HBM" => (StorageTier::Device, true),
        "CPU" | "CPU_PINNED" | "HOST" => (StorageTier::Host, true),
        "DISK" | "STORAGE" | "SSD" | "NVME" => (StorageTier::Disk, true),
        // SGLang's L4 pool (Mooncake and the like) and LMCache's remote backends.
        "EXTERNAL" | "REMOTE" | "LMCACHE" => (StorageTier::Remote, true),
        // A medium named by a newer engine: somewhere off the device, reached at an unknown
        // cost; the remote tier (the costliest the router prices) until it is mapped here.
        _ => (StorageTier::Remote, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::{WorkerId, block_hashes};

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> EngineEvent {
        EngineEvent::BlockStored(StoredEvent {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: tokens,
            block_size: Some(2),
            medium: Some("GPU".into()),
            ..StoredEvent::default()
        })
    }

    fn batch(events: Vec<EngineEvent>) -> EngineBatch {
        EngineBatch {
            events,
            skipped: Vec::new(),
            dp_rank: None,
        }
    }

    fn setup(ranks: u32) -> (KvRelay, EventLog, AdapterCounters) {
        let bs = BlockSize::new(2).unwrap();
        (
            KvRelay::new(bs, ranks, 1000),
            EventLog::new(WorkerId::new("w").unwrap(), 1, 100),
            AdapterCounters::default(),
        )
    }

    #[test]
    fn stored_blocks_are_rehashed_with_our_chain() {
        let (mut relay, log, c) = setup(1);
        relay.apply(
            0,
            &batch(vec![
                stored(&[0xa, 0xb], None, vec![1, 2, 3, 4]),
                stored(&[0xc], Some(0xb), vec![5, 6]),
            ]),
            &log,
            &c,
        );
        let ours = block_hashes(&[1, 2, 3, 4, 5, 6], BlockSize::new(2).unwrap());
        let sub = log.subscribe(None, 0);
        let crate::event_log::SubscriptionStart::Snapshot { blocks, .. } = sub.start else {
            panic!("snapshot expected")
        };
        let mut got: Vec<_> = blocks.iter().map(|b| b.hash).collect();
        let mut want = ours.clone();
        got.sort();
        want.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn ranks_share_blocks_and_a_reset_removes_only_the_exclusive_ones() {
        let (mut relay, log, c) = setup(2);
        relay.apply(
            0,
            &batch(vec![stored(&[1, 2], None, vec![1, 2, 3, 4])]),
            &log,
            &c,
        );
        // Rank 1 holds the first block too (its own engine hash for it).
        relay.apply(1, &batch(vec![stored(&[77], None, vec![1, 2])]), &log, &c);
        assert_eq!(log.block_count(), 2);
        relay.reset_and_publish(0, &log);
        assert_eq!(log.block_count(), 1);
        relay.apply(
            1,
            &batch(vec![EngineEvent::BlockRemoved {
                block_hashes: vec![77],
                medium: None,
                group: 0,
            }]),
            &log,
            &c,
        );
        assert_eq!(log.block_count(), 0);
        assert_eq!(relay.block_count(), 0);
    }

    fn removed(hashes: &[u64], group: u32) -> EngineEvent {
        EngineEvent::BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: Some("GPU".into()),
            group,
        }
    }

    #[test]
    fn re_announced_blocks_are_held_once_and_leave_with_one_removal() {
        let (mut relay, log, c) = setup(1);
        relay.apply(
            0,
            &batch(vec![stored(&[1, 2], None, vec![1, 2, 3, 4])]),
            &log,
            &c,
        );
        // vLLM's `kv_cache_report_mode = "full"`: the whole prefix again, no parent.
        relay.apply(
            0,
            &batch(vec![stored(&[1, 2], None, vec![1, 2, 3, 4])]),
            &log,
            &c,
        );
        assert_eq!(c.snapshot().duplicate_stores, 2);
        relay.apply(
            0,
            &batch(vec![removed(&[2], 0), removed(&[1], 0)]),
            &log,
            &c,
        );
        assert_eq!(relay.block_count(), 0, "nothing leaks");
        assert_eq!(log.block_count(), 0);
        // A removal of something unknown is counted and harmless.
        relay.apply(
            0,
            &batch(vec![removed(&[9], 0), removed(&[1], 3)]),
            &log,
            &c,
        );
        assert_eq!(c.snapshot().unknown_removals, 2);
    }

    #[test]
    fn kv_cache_groups_are_tracked_apart() {
        let (mut relay, log, c) = setup(1);
        let in_group = |group| {
            EngineEvent::BlockStored(StoredEvent {
                block_hashes: vec![1],
                token_ids: vec![1, 2],
                block_size: Some(2),
                medium: Some("GPU".into()),
                group,
                ..StoredEvent::default()
            })
        };
        // A hybrid model: the same engine hash in groups 0 and 1.
        relay.apply(0, &batch(vec![in_group(0), in_group(1)]), &log, &c);
        assert_eq!(relay.block_count(), 1);
        relay.apply(0, &batch(vec![removed(&[1], 0)]), &log, &c);
        assert_eq!(relay.block_count(), 1, "group 1 still holds it");
        relay.apply(0, &batch(vec![removed(&[1], 1)]), &log, &c);
        assert_eq!(relay.block_count(), 0);
        assert_eq!(c.snapshot().unknown_removals, 0);
        // A sliding-window group names no prefix.
        let window = EngineEvent::BlockStored(StoredEvent {
            spec_kind: Some("sliding_window".into()),
            ..match in_group(2) {
                EngineEvent::BlockStored(e) => e,
                _ => unreachable!(),
            }
        });
        relay.apply(0, &batch(vec![window]), &log, &c);
        assert_eq!(relay.block_count(), 0);
        assert_eq!(c.snapshot().other_groups, 1);
    }

    #[test]
    fn media_map_to_tiers_and_unknown_media_are_counted() {
        assert_eq!(tier(None), (StorageTier::Device, true));
        assert_eq!(tier(Some("GPU")), (StorageTier::Device, true));
        assert_eq!(tier(Some("cpu")), (StorageTier::Host, true));
        assert_eq!(tier(Some("CPU_PINNED")), (StorageTier::Host, true));
        assert_eq!(tier(Some("STORAGE")), (StorageTier::Disk, true));
        assert_eq!(tier(Some("EXTERNAL")), (StorageTier::Remote, true));
        assert_eq!(tier(Some("QUANTUM")), (StorageTier::Remote, false));
        let (mut relay, log, c) = setup(1);
        let event = EngineEvent::BlockStored(StoredEvent {
            block_hashes: vec![1],
            token_ids: vec![1, 2],
            block_size: Some(2),
            medium: Some("EXTERNAL".into()),
            ..StoredEvent::default()
        });
        relay.apply(0, &batch(vec![event]), &log, &c);
        assert_eq!(
            relay.held_blocks()[0].1,
            StorageTier::Remote,
            "the remote tier, never a device hit"
        );
    }

    #[test]
    fn a_larger_engine_block_size_is_refused_and_reported() {
        let (mut relay, log, c) = setup(1);
        let event = EngineEvent::BlockStored(StoredEvent {
            block_hashes: vec![1],
            token_ids: vec![1, 2, 3, 4],
            block_size: Some(4),
            ..StoredEvent::default()
        });
        relay.apply(0, &batch(vec![event]), &log, &c);
        assert_eq!(c.snapshot().block_size_mismatches, 1);
        assert_eq!(relay.block_count(), 0, "never mapped to the wrong tokens");
    }

    #[test]
    fn keyed_blocks_never_share_a_name_with_plain_ones() {
        let (mut relay, log, c) = setup(1);
        let key = switchyard_core::block_key(&[Some(b"adapter".as_slice())]);
        let keyed = EngineEvent::BlockStored(StoredEvent {
            block_hashes: vec![5],
            token_ids: vec![1, 2],
            block_size: Some(2),
            block_keys: vec![key],
            ..StoredEvent::default()
        });
        relay.apply(
            0,
            &batch(vec![stored(&[4], None, vec![1, 2]), keyed]),
            &log,
            &c,
        );
        assert_eq!(relay.block_count(), 2, "same tokens, two blocks");
    }

    #[test]
    fn partial_pages_and_unknown_parents_are_skipped_and_counted() {
        let (mut relay, log, c) = setup(1);
        relay.apply(0, &batch(vec![stored(&[1], None, vec![1])]), &log, &c);
        relay.apply(
            0,
            &batch(vec![stored(&[2], Some(99), vec![1, 2])]),
            &log,
            &c,
        );
        let stats = c.snapshot();
        assert_eq!(stats.partial_blocks, 1);
        assert_eq!(stats.unrelatable, 1);
        assert_eq!(log.block_count(), 0);
    }
}
