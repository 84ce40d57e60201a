//! Tests of the holder map: its two generations and the slab against a plain model.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const R: BlockHash = BlockHash::ROOT;

fn add(m: &mut HolderMap, b: BlockHash, slot: u32, tiers: u8) -> PairChange {
    m.add(b, slot, tiers, R, 0).0
}

fn remove(m: &mut HolderMap, b: BlockHash, slot: u32, tiers: u8) -> PairChange {
    m.remove(b, slot, tiers).change
}

#[test]
fn holders_stay_sorted_and_fold_back_inline() {
    let mut m = HolderMap::default();
    let b = BlockHash(42);
    assert_eq!(add(&mut m, b, 5, DEVICE), PairChange::Added);
    assert_eq!(add(&mut m, b, 5, HOST), PairChange::Kept);
    assert_eq!(m.tiers_of(b, 5), DEVICE | HOST);
    assert_eq!(add(&mut m, b, 2, DEVICE), PairChange::Added);
    assert_eq!(add(&mut m, b, 9, DISK), PairChange::Added);
    let slots: Vec<u32> = m.get(b).iter().map(|h| h.slot()).collect();
    assert_eq!(slots, vec![2, 5, 9]);
    assert_eq!(remove(&mut m, b, 2, DEVICE), PairChange::Removed);
    assert_eq!(remove(&mut m, b, 9, DEVICE), PairChange::Kept);
    assert_eq!(remove(&mut m, b, 9, DISK), PairChange::Removed);
    assert_eq!(m.get(b).len(), 1);
    assert_eq!(remove(&mut m, b, 5, DEVICE), PairChange::Kept);
    assert_eq!(remove(&mut m, b, 7, DEVICE), PairChange::Absent);
    assert_eq!(remove(&mut m, b, 5, HOST), PairChange::Removed);
    assert_eq!(m.blocks(), 0);
    // The slab's chunks are reused: a new shared block takes a freed chunk.
    let used = m.slab.heap_bytes();
    add(&mut m, b, 1, DEVICE);
    add(&mut m, b, 3, DEVICE);
    assert_eq!(m.slab.heap_bytes(), used);
}

#[test]
fn the_four_tier_bits_slot_and_child_count_do_not_overlap() {
    let top = (MAX_SLOTS - 1) as u32;
    let all = ALL_TIERS;
    let h = Holder::new(top, all).with_children(CHILD_MAX);
    assert_eq!((h.slot(), h.tiers(), h.children()), (top, all, CHILD_MAX));
    let h = h.with_tiers(REMOTE);
    assert_eq!(
        (h.slot(), h.tiers(), h.children()),
        (top, REMOTE, CHILD_MAX)
    );
    let remote_only = Holder::new(0, REMOTE);
    assert_eq!((remote_only.slot(), remote_only.children()), (0, 0));
}

#[test]
fn parents_are_kept_and_child_counts_survive_tier_changes_and_saturate() {
    let mut m = HolderMap::default();
    let (p, c) = (BlockHash(1), BlockHash(2));
    assert_eq!(m.add(p, 3, DEVICE, R, 0), (PairChange::Added, 0, R));
    assert_eq!(m.add(c, 3, DEVICE, p, 0), (PairChange::Added, 0, p));
    // A later claim of another parent does not overwrite the first one.
    assert_eq!(
        m.add(c, 4, DEVICE, BlockHash(9), 2),
        (PairChange::Added, 0, p)
    );
    assert_eq!(m.holder(c, 4).map(Holder::children), Some(2));
    assert!(m.adjust_children(p, 3, 1));
    assert!(
        !m.adjust_children(p, 4, 1),
        "worker 4 does not hold the parent"
    );
    assert_eq!(m.add(p, 3, HOST, R, 1).1, DEVICE);
    assert_eq!(m.holder(p, 3).map(Holder::children), Some(2));
    assert!(m.adjust_children(p, 3, -1));
    let r = m.remove(p, 3, DEVICE);
    assert_eq!(
        (r.change, r.before.children(), r.before.tiers()),
        (PairChange::Kept, 1, DEVICE | HOST)
    );
    assert!(m.adjust_children(p, 3, -1));
    assert!(m.adjust_children(p, 3, -1), "saturates at zero");
    assert_eq!(m.holder(p, 3).map(Holder::children), Some(0));
    for _ in 0..20 {
        m.adjust_children(p, 3, 1);
    }
    m.adjust_children(p, 3, -1);
    assert_eq!(
        m.holder(p, 3).map(Holder::children),
        Some(CHILD_MAX),
        "a saturated count stays"
    );
    assert_eq!(m.holder(p, 3).map(Holder::slot), Some(3));
    assert_eq!(m.tiers_of(p, 3), HOST);
    let r = m.remove(c, 4, DEVICE);
    assert_eq!((r.change, r.parent), (PairChange::Removed, p));
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        block: u64,
        slot: u32,
        tiers: u8,
        parent: u64,
        children: u32,
        /// A new block goes straight into the old map.
        straight: bool,
    },
    Remove {
        block: u64,
        slot: u32,
        tiers: u8,
    },
    Adjust {
        block: u64,
        slot: u32,
        up: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    // Few blocks and many slots, so lists grow through several chunk classes and shrink.
    let (block, slot, tiers) = (0u64..12, 0u32..40, 1u8..16);
    prop_oneof![
        6 => (block.clone(), slot.clone(), tiers.clone(), 0u64..3, 0u32..3, proptest::bool::ANY).prop_map(
            |(block, slot, tiers, parent, children, straight)| Op::Add { block, slot, tiers, parent, children, straight }
        ),
        4 => (block.clone(), slot.clone(), tiers).prop_map(|(block, slot, tiers)| Op::Remove { block, slot, tiers }),
        2 => (block, slot, proptest::bool::ANY).prop_map(|(block, slot, up)| Op::Adjust { block, slot, up }),
    ]
}

/// The map as the model keeps it: per block, its recorded parent and `slot → (tiers, children)`.
type Model = BTreeMap<u64, (u64, BTreeMap<u32, (u8, u32)>)>;

proptest! {
    /// Against a plain model, with a young map promoted every few blocks and some new blocks
    /// sent straight into the old map: every change
    /// answers as the model does and every block's holders read back as the model has them,
    /// whichever map and slab chunk they sit in.
    #[test]
    fn the_two_maps_and_the_slab_answer_as_a_plain_model(
        ops in proptest::collection::vec(op(), 0..400),
        young_max in 1usize..6,
        stale_slack in 1usize..4,
    ) {
        let mut m = HolderMap { young_max, ..HolderMap::default() };
        // Rebuild the old map's presence filter every few removals.
        m.old.stale_slack = stale_slack;
        let mut model = Model::new();
        for op in &ops {
            match *op {
                Op::Add { block, slot, tiers, parent, children, straight } => {
                    let (holders_parent, holders) = model.entry(block).or_insert((parent, BTreeMap::new()));
                    let recorded = *holders_parent;
                    let (change, before) = match holders.get_mut(&slot) {
                        Some((t, c)) => {
                            let before = *t;
                            *t |= tiers;
                            if *c != CHILD_MAX {
                                *c = (*c + children).min(CHILD_MAX);
                            }
                            (PairChange::Kept, before)
                        }
                        None => {
                            holders.insert(slot, (tiers, children));
                            (PairChange::Added, 0)
                        }
                    };
                    m.set_straight_to_old(straight);
                    let got = m.add(BlockHash(block), slot, tiers, BlockHash(parent), children);
                    prop_assert_eq!(got, (change, before, BlockHash(recorded)));
                }
                Op::Remove { block, slot, tiers } => {
                    let want = match model.get_mut(&block) {
                        Some((parent, holders)) => match holders.get_mut(&slot) {
                            Some((t, c)) => {
                                let before = Holder::new(slot, *t).with_children(*c);
                                *t &= !tiers;
                                let change = if *t == 0 {
                                    holders.remove(&slot);
                                    PairChange::Removed
                                } else {
                                    PairChange::Kept
                                };
                                Some((change, before, BlockHash(*parent)))
                            }
                            None => None,
                        },
                        None => None,
                    };
                    if model.get(&block).is_some_and(|(_, h)| h.is_empty()) {
                        model.remove(&block);
                    }
                    let r = m.remove(BlockHash(block), slot, tiers);
                    match want {
                        Some(w) => prop_assert_eq!((r.change, r.before, r.parent), w),
                        None => prop_assert_eq!(r.change, PairChange::Absent),
                    }
                }
                Op::Adjust { block, slot, up } => {
                    let held = match model.get_mut(&block).and_then(|(_, h)| h.get_mut(&slot)) {
                        Some((_, c)) => {
                            if *c != CHILD_MAX {
                                *c = if up { (*c + 1).min(CHILD_MAX) } else { c.saturating_sub(1) };
                            }
                            true
                        }
                        None => false,
                    };
                    prop_assert_eq!(m.adjust_children(BlockHash(block), slot, if up { 1 } else { -1 }), held);
                }
            }
            prop_assert!(m.young.len() < m.young_limit().max(1));
            prop_assert!(m.old.filter_is_sound());
            prop_assert_eq!(m.blocks(), model.len());
            for block in 0..12u64 {
                let got: Vec<(u32, u8, u32)> = m
                    .get(BlockHash(block))
                    .iter()
                    .map(|h| (h.slot(), h.tiers(), h.children()))
                    .collect();
                let want: Vec<(u32, u8, u32)> = model
                    .get(&block)
                    .map(|(_, h)| h.iter().map(|(&s, &(t, c))| (s, t, c)).collect())
                    .unwrap_or_default();
                prop_assert_eq!(got, want);
            }
        }
    }
}
