//! Collects the KV events of one step, merging neighbours into the fewest events.

use switchyard_core::{BlockHash, KvEvent, StorageTier, StoredBlock, TokenId};

/// The ordered events of one step.
///
/// Consecutive removals from the same tier share one `Removed`, and a stored block whose parent
/// is the last block of the previous `Stored` of the same tier extends it, so a prefill chunk or
/// a burst of evictions is one event rather than one per block. Merging only ever joins
/// neighbours, so the order consumers apply the events in is unchanged.
#[derive(Debug, Default)]
pub(crate) struct EventLog {
    events: Vec<KvEvent>,
}

impl EventLog {
    pub(crate) fn removed(&mut self, tier: StorageTier, hash: BlockHash) {
        if let Some(KvEvent::Removed { blocks, tier: last }) = self.events.last_mut()
            && *last == tier
        {
            blocks.push(hash);
            return;
        }
        self.events.push(KvEvent::Removed {
            blocks: vec![hash],
            tier,
        });
    }

    pub(crate) fn stored(
        &mut self,
        tier: StorageTier,
        parent: Option<BlockHash>,
        hash: BlockHash,
        tokens: Vec<TokenId>,
    ) {
        if let Some(KvEvent::Stored {
            blocks, tier: last, ..
        }) = self.events.last_mut()
            && *last == tier
            && parent.is_some()
            && blocks.last().map(|b| b.hash) == parent
        {
            blocks.push(StoredBlock { hash, tokens });
            return;
        }
        self.events.push(KvEvent::Stored {
            parent,
            blocks: vec![StoredBlock { hash, tokens }],
            tier,
        });
    }

    pub(crate) fn into_events(self) -> Vec<KvEvent> {
        self.events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::chain_hash;

    #[test]
    fn neighbours_merge_and_others_do_not() {
        let mut log = EventLog::default();
        let a = chain_hash(None, &[1]);
        let b = chain_hash(Some(a), &[2]);
        log.stored(StorageTier::Device, None, a, vec![1]);
        log.stored(StorageTier::Device, Some(a), b, vec![2]);
        log.removed(StorageTier::Device, BlockHash(7));
        log.removed(StorageTier::Device, BlockHash(8));
        log.removed(StorageTier::Host, BlockHash(9));
        // A first block never joins the previous event even if the tier matches.
        log.stored(StorageTier::Host, None, a, vec![1]);
        log.stored(StorageTier::Host, None, a, vec![1]);
        let events = log.into_events();
        assert_eq!(events.len(), 5);
        assert_eq!(events[0].block_count(), 2);
        assert_eq!(events[1].block_count(), 2);
    }
}
