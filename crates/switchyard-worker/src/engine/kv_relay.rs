//! Turning decoded engine batches into Switchyard [`KvEvent`]s in the worker's [`EventLog`].
//!
//! Each data-parallel rank is its own engine-hash namespace (its own [`EngineHashMap`]), but all
//! ranks publish into the worker's one event log, whose view is a set of blocks. Two ranks can
//! hold the same block (same tokens, same chained hash), so the relay counts, per block and tier,
//! how many ranks hold it: a block is announced removed only when the last rank drops it, and a
//! rank that restarts or loses events removes only the blocks no other rank still holds.

use std::collections::{HashMap, HashSet};

use switchyard_core::{BlockHash, BlockSize, KvEvent, StorageTier};
use switchyard_router::EngineHashMap;

use super::kv_decode::{EngineBatch, EngineEvent};
use super::stats::{AdapterCounters, RankCounters};
use crate::event_log::EventLog;

type BlockKey = (BlockHash, StorageTier);

/// One rank's view: its hash map and how many of its engine blocks map to each of our blocks.
#[derive(Debug)]
struct RankView {
    map: EngineHashMap,
    held: HashMap<BlockKey, u32>,
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
        let ranks = (0..dp_ranks.max(1))
            .map(|_| RankView {
                map: EngineHashMap::new(block_size, map_capacity),
                held: HashMap::new(),
            })
            .collect();
        Self {
            block_size,
            map_capacity,
            ranks,
            holders: HashMap::new(),
        }
    }

    /// Blocks (per tier) that at least one rank holds.
    pub fn block_count(&self) -> usize {
        self.holders.len()
    }

    /// Applies one engine batch from `rank` and publishes the resulting events.
    pub fn apply(&mut self, rank: u32, batch: &EngineBatch, log: &EventLog, c: &AdapterCounters) {
        let c = c.rank(rank);
        let mut out = Vec::new();
        for event in &batch.events {
            match event {
                EngineEvent::BlockStored {
                    block_hashes,
                    parent,
                    token_ids,
                    medium,
                    ..
                } => {
                    if let Some(ev) =
                        self.stored(rank, *parent, block_hashes, token_ids, tier(medium), c)
                    {
                        out.push(ev);
                    }
                }
                EngineEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    if let Some(ev) = self.removed(rank, block_hashes, tier(medium)) {
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

    fn stored(
        &mut self,
        rank: u32,
        parent: Option<u64>,
        hashes: &[u64],
        tokens: &[u32],
        tier: StorageTier,
        c: &RankCounters,
    ) -> Option<KvEvent> {
        let bs = self.block_size.as_usize();
        // Only full blocks have keys: SGLang may send a partial last page, which is skipped.
        let full = hashes.len().min(tokens.len() / bs);
        if full < hashes.len() {
            c.add(&c.partial_blocks, (hashes.len() - full) as u64);
        }
        if full == 0 {
            return None;
        }
        let view = self.rank(rank)?;
        let event = match view
            .map
            .stored(parent, &hashes[..full], &tokens[..full * bs], tier)
        {
            Ok(event) => event,
            Err(err) => {
                // The parent was never seen (we joined late or lost it): the chain cannot be
                // rehashed; those blocks stay unknown until the engine stores them afresh.
                c.add(&c.unrelatable, 1);
                tracing::debug!(rank, error = %err, "engine BlockStored skipped");
                return None;
            }
        };
        if let KvEvent::Stored { blocks, .. } = &event {
            let mut newly = Vec::new();
            for block in blocks {
                let count = view.held.entry((block.hash, tier)).or_insert(0);
                *count += 1;
                if *count == 1 {
                    newly.push((block.hash, tier));
                }
            }
            for key in newly {
                *self.holders.entry(key).or_insert(0) += 1;
            }
        }
        Some(event)
    }

    fn removed(&mut self, rank: u32, hashes: &[u64], tier: StorageTier) -> Option<KvEvent> {
        let view = self.rank(rank)?;
        let KvEvent::Removed { blocks, tier } = view.map.removed(hashes, tier) else {
            return None;
        };
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
        let block_size = self.block_size;
        let capacity = self.map_capacity;
        let Some(view) = self.rank(rank) else {
            return Vec::new();
        };
        let held: Vec<BlockKey> = view.held.drain().map(|(k, _)| k).collect();
        view.map = EngineHashMap::new(block_size, capacity);
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

/// The tier an engine `medium` names; the device when absent or unknown.
fn tier(medium: &Option<String>) -> StorageTier {
    match medium.as_deref() {
        None => StorageTier::Device,
        Some(m) => {
            let m = m.to_ascii_uppercase();
            if m.starts_with("CPU") || m.starts_with("HOST") {
                StorageTier::Host
            } else if m.starts_with("DISK") || m.starts_with("NVME") || m.starts_with("SSD") {
                StorageTier::Disk
            } else {
                StorageTier::Device
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::{WorkerId, block_hashes};

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> EngineEvent {
        EngineEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: tokens,
            block_size: Some(2),
            medium: Some("GPU".into()),
        }
    }

    fn batch(events: Vec<EngineEvent>) -> EngineBatch {
        EngineBatch {
            events,
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
            }]),
            &log,
            &c,
        );
        assert_eq!(log.block_count(), 0);
        assert_eq!(relay.block_count(), 0);
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
