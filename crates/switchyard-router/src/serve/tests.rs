#![allow(clippy::unwrap_used, clippy::expect_used)]

use switchyard_core::{KvEvent, StorageTier, StoredBlock, block_hashes};

use super::*;
use crate::load::BookedRequest;

const BS: u32 = 16;

fn bs() -> BlockSize {
    BlockSize::new(BS).unwrap()
}

fn w(n: &str) -> WorkerId {
    WorkerId::new(n).unwrap()
}

fn prompt(blocks: u32) -> Vec<TokenId> {
    (0..blocks * BS).collect()
}

fn core(kind: PolicyKind) -> ServingCore {
    ServingCore::new(
        bs(),
        IndexConfig::new(bs()),
        LoadConfig::default(),
        kind,
        &PolicyConfig::default(),
    )
    .unwrap()
}

/// `worker` holds the first `blocks` blocks of `tokens` on device.
fn store(core: &mut ServingCore, worker: &str, tokens: &[TokenId], blocks: usize) {
    let hashes = block_hashes(tokens, bs());
    let event = KvEvent::Stored {
        parent: None,
        blocks: (0..blocks)
            .map(|i| StoredBlock {
                hash: hashes[i],
                tokens: tokens[i * BS as usize..(i + 1) * BS as usize].to_vec(),
            })
            .collect(),
        tier: StorageTier::Device,
    };
    core.index.apply(&w(worker), 1, 0, &event).unwrap();
}

fn candidates(names: &[&str]) -> Vec<Candidate> {
    names.iter().map(|n| Candidate::from(w(n))).collect()
}

fn booked(core: &ServingCore, worker: &str) -> Vec<BookedRequest> {
    core.load
        .bookings()
        .into_iter()
        .filter(|b| b.worker == w(worker))
        .collect()
}

fn auto() -> ServeSettings {
    ServeSettings {
        disaggregation: Disaggregation::Auto,
        ..ServeSettings::default()
    }
}

#[test]
fn an_aggregated_request_books_its_uncached_prompt_and_prompt_plus_output_blocks() {
    let mut core = core(PolicyKind::Kv);
    let tokens = prompt(10);
    store(&mut core, "d", &tokens, 4);
    let request = route_request(&tokens, bs(), None, 7);
    let (decision, booking) = core
        .route_decode(&request, &candidates(&["d"]), 40)
        .unwrap();
    assert_eq!(decision.worker, w("d"));
    assert_eq!(booking.kind, BookingKind::Aggregated);
    assert_eq!(booking.uncached_prompt_tokens, 6 * 16);
    assert_eq!(booking.prefill_tokens, 6 * 16);
    // (160 prompt + 40 output) tokens of KV: 13 blocks of 16, the gateway's and replay's rule.
    assert_eq!(booking.blocks, 13);
    assert_eq!(
        booked(&core, "d"),
        vec![BookedRequest {
            worker: w("d"),
            request: booking.key,
            routed_at: 7,
            prefill_tokens: 96,
            blocks: 13,
            prefill_done: false,
        }]
    );
    core.prefill_done(&booking);
    assert!(booked(&core, "d")[0].prefill_done);
    core.finished(&booking);
    assert!(core.load.bookings().is_empty());
}

#[test]
fn a_disaggregated_decode_worker_books_no_prefill_and_the_prefill_worker_its_own_uncached() {
    let mut core = core(PolicyKind::Kv);
    let tokens = prompt(200);
    // The prefill worker already holds 50 blocks of the prompt.
    store(&mut core, "p", &tokens, 50);
    let request = route_request(&tokens, bs(), None, 1);
    let (_, mut decode) = core.route_decode(&request, &candidates(&["d"]), 8).unwrap();
    assert_eq!(decode.prefill_tokens, 3200);
    let ModeChoice::TryPrefill { forced: false } =
        serving_mode(&auto(), decode.uncached_prompt_tokens, false)
    else {
        panic!("3200 uncached tokens go to the prefill pool under auto");
    };
    let PrefillChoice::Chosen(choice) =
        core.choose_prefill(&auto(), &request, &candidates(&["p"]), false)
    else {
        panic!("the prefill pool has a worker");
    };
    let prefill = core.book_prefill(&choice, &request, &mut decode);
    assert_eq!(prefill.kind, BookingKind::Prefill);
    assert_eq!(prefill.prefill_tokens, 150 * 16);
    assert_eq!(
        prefill.blocks, 200,
        "the prompt's blocks only: it generates one token"
    );
    assert_eq!(decode.kind, BookingKind::DisaggregatedDecode);
    assert_eq!(decode.prefill_tokens, 0);
    assert_eq!(decode.blocks, (3200u64 + 8).div_ceil(16));
    assert_eq!(booked(&core, "d")[0].prefill_tokens, 0);
    assert_eq!(booked(&core, "p")[0].prefill_tokens, 2400);

    // The prefill fails: the decode worker computes the prompt itself again.
    core.prefill_failed(&prefill, &mut decode);
    assert!(booked(&core, "p").is_empty());
    assert_eq!(decode.kind, BookingKind::Aggregated);
    assert_eq!(booked(&core, "d")[0].prefill_tokens, 3200);
}

#[test]
fn the_threshold_compares_the_decode_workers_uncached_tokens_not_the_prompt_length() {
    let mut core = core(PolicyKind::Kv);
    let tokens = prompt(640); // 10,240 tokens
    store(&mut core, "d", &tokens, 600);
    let request = route_request(&tokens, bs(), None, 0);
    let (_, decode) = core.route_decode(&request, &candidates(&["d"]), 8).unwrap();
    assert_eq!(decode.uncached_prompt_tokens, 640);
    match serving_mode(&auto(), decode.uncached_prompt_tokens, false) {
        ModeChoice::Aggregated(why) => assert!(why.contains("640 uncached"), "{why}"),
        other => panic!("a long prompt mostly cached stays aggregated: {other:?}"),
    }
    assert_eq!(
        serving_mode(&auto(), 2048, false),
        ModeChoice::TryPrefill { forced: false }
    );
    assert_eq!(
        serving_mode(&auto(), 0, true),
        ModeChoice::TryPrefill { forced: true },
        "a decode worker that needs a prefill worker goes through the pool whatever the threshold"
    );
    let enforce = ServeSettings {
        disaggregation: Disaggregation::Enforce,
        ..ServeSettings::default()
    };
    assert_eq!(
        serving_mode(&enforce, 0, false),
        ModeChoice::TryPrefill { forced: false }
    );
    assert!(matches!(
        serving_mode(&ServeSettings::default(), u64::MAX, false),
        ModeChoice::Aggregated(_)
    ));
}

#[test]
fn saturation_keeps_auto_aggregated_but_not_enforce_nor_a_worker_that_needs_prefill() {
    let mut core = core(PolicyKind::Kv);
    let settings = ServeSettings {
        max_prefill_queue_tokens: 1000,
        ..auto()
    };
    core.load.on_routed(&w("p"), 999, 5000, 10, 0);
    let tokens = prompt(200);
    let request = route_request(&tokens, bs(), None, 1);
    match core.choose_prefill(&settings, &request, &candidates(&["p"]), false) {
        PrefillChoice::Saturated { decision, why } => {
            assert_eq!(decision.worker, w("p"));
            assert!(
                why.contains("5000 prefill tokens queued (limit 1000)"),
                "{why}"
            );
        }
        other => panic!("a saturated pool keeps auto aggregated: {other:?}"),
    }
    assert!(matches!(
        core.choose_prefill(&settings, &request, &candidates(&["p"]), true),
        PrefillChoice::Chosen(_)
    ));
    let enforce = ServeSettings {
        disaggregation: Disaggregation::Enforce,
        ..settings
    };
    assert!(matches!(
        core.choose_prefill(&enforce, &request, &candidates(&["p"]), false),
        PrefillChoice::Chosen(_)
    ));
    assert!(matches!(
        core.choose_prefill(&enforce, &request, &[], false),
        PrefillChoice::Unavailable(RouteError::NoCandidates)
    ));
}

#[test]
fn one_set_of_defaults() {
    let defaults = ServeSettings::default();
    assert_eq!(defaults.disaggregation, Disaggregation::Off);
    assert_eq!(defaults.min_uncached_tokens, 2048);
    assert_eq!(defaults.max_prefill_queue_tokens, 262_144);
    assert_eq!(
        "Enforce".parse::<Disaggregation>(),
        Ok(Disaggregation::Enforce)
    );
    assert!("sometimes".parse::<Disaggregation>().is_err());
    assert!(aggregated_only(&defaults, false, false));
    assert!(!aggregated_only(&auto(), false, false));
    assert!(aggregated_only(&auto(), true, false));
    assert!(aggregated_only(&auto(), false, true));
}

#[test]
fn explain_changes_nothing_and_agrees_with_the_decision() {
    let mut core = core(PolicyKind::RoundRobin);
    let tokens = prompt(4);
    let request = route_request(&tokens, bs(), None, 0);
    let all = candidates(&["a", "b", "c"]);
    let previewed = core.explain_decode(&request, &all).unwrap();
    let again = core.explain_decode(&request, &all).unwrap();
    assert_eq!(
        previewed.worker, again.worker,
        "a preview does not move the turn"
    );
    assert!(core.load.bookings().is_empty());
    let (decided, _) = core.route_decode(&request, &all, 1).unwrap();
    assert_eq!(decided.worker, previewed.worker);
    assert!(matches!(
        core.route_decode(&request, &[], 1),
        Err(RouteError::NoCandidates)
    ));
}

#[test]
fn booking_keys_are_unique_per_core() {
    let mut core = core(PolicyKind::Kv);
    let request = route_request(&prompt(2), bs(), None, 0);
    let (_, a) = core.route_decode(&request, &candidates(&["a"]), 1).unwrap();
    let (_, mut b) = core.route_decode(&request, &candidates(&["a"]), 1).unwrap();
    let choice = match core.choose_prefill(&auto(), &request, &candidates(&["p"]), false) {
        PrefillChoice::Chosen(d) => d,
        other => panic!("{other:?}"),
    };
    let c = core.book_prefill(&choice, &request, &mut b);
    assert!(a.key != b.key && b.key != c.key && a.key != c.key);
}

#[test]
fn ranked_puts_the_choice_first_then_the_rest_by_cost() {
    let mut core = core(PolicyKind::Kv);
    let tokens = prompt(8);
    store(&mut core, "b", &tokens, 8);
    store(&mut core, "c", &tokens, 4);
    let request = route_request(&tokens, bs(), None, 0);
    let (decision, _) = core
        .route_decode(&request, &candidates(&["a", "b", "c"]), 16)
        .unwrap();
    let ranked: Vec<&str> = decision
        .ranked(&request)
        .iter()
        .map(|w| w.as_str())
        .collect();
    assert_eq!(ranked, ["b", "c", "a"]);
}

#[test]
fn a_moved_booking_leaves_the_chosen_worker_and_counts_on_the_server() {
    let mut core = core(PolicyKind::Kv);
    let tokens = prompt(8);
    store(&mut core, "b", &tokens, 8);
    store(&mut core, "c", &tokens, 4);
    let request = route_request(&tokens, bs(), None, 0);
    let (decision, booking) = core
        .route_decode(&request, &candidates(&["a", "b", "c"]), 16)
        .unwrap();
    assert_eq!(booking.worker, w("b"));
    let moved = core.move_booking(&booking, &decision, &w("c"), &request, 16);
    assert!(booked(&core, "b").is_empty());
    let on_c = booked(&core, "c");
    assert_eq!(on_c.len(), 1);
    // c holds half the prompt: it computes the other half.
    assert_eq!(moved.uncached_prompt_tokens, u64::from(4 * BS));
    assert_eq!(moved.worker, w("c"));
    core.finished(&moved);
    assert!(booked(&core, "c").is_empty());
}

/// Tokens of a chain of their own (`family` apart from `prompt`'s).
fn distinct(family: u32, tokens: u32) -> Vec<TokenId> {
    (0..tokens).map(|i| family * 1_000_000 + i).collect()
}

#[test]
fn a_prefix_in_flight_counts_once_a_step_of_work_lies_between_it_and_the_request() {
    use crate::load::pending::Incoming;
    use switchyard_core::LoadStats;
    let mut core = core(PolicyKind::Kv);
    let queued = |tokens| LoadStats {
        queued_prefill_tokens: tokens,
        ..LoadStats::default()
    };
    core.load.report(&w("a"), queued(15_000), 0);
    core.load.report(&w("b"), queued(10_000), 0);
    // `a` has a request in flight computing a 600-block prompt (its load is in the report).
    let first = prompt(600);
    let first_blocks = route_request(&first, bs(), None, 0).block_hashes;
    core.load.add_pending(
        Incoming {
            request: 1,
            worker: &w("a"),
            blocks: &first_blocks,
            prompt_tokens: 9_600,
            prefill_tokens: 9_600,
        },
        0,
    );
    // A request sharing 590 of those blocks: with nothing queued behind the first, both would
    // prefill in the same step (10 blocks apart), so the shared blocks do not count and the
    // less loaded `b` wins.
    let mut tokens = prompt(590);
    tokens.extend(distinct(1, 160));
    let request = route_request(&tokens, bs(), None, 1);
    let decide = |core: &ServingCore| {
        core.explain_decode(&request, &candidates(&["a", "b"]))
            .unwrap()
    };
    let decision = decide(&core);
    assert_eq!(decision.worker, w("b"), "{}", decision.explanation.why);
    assert!(
        decision
            .explanation
            .workers
            .iter()
            .all(|s| s.pending_blocks == 0)
    );
    // 9,000 tokens queued behind the first request on `a` (more than the 8,192 of a step): the
    // shared blocks are computed before the request is scheduled, and `a` wins.
    let other = route_request(&distinct(2, 9_000), bs(), None, 0).block_hashes;
    core.load.add_pending(
        Incoming {
            request: 2,
            worker: &w("a"),
            blocks: &other,
            prompt_tokens: 9_000,
            prefill_tokens: 9_000,
        },
        0,
    );
    let decision = decide(&core);
    assert_eq!(decision.worker, w("a"), "{}", decision.explanation.why);
    let a = &decision.explanation.workers[0];
    assert_eq!(a.worker, w("a"));
    assert_eq!((a.pending_blocks, a.overlap.device), (590, 590));
    assert_eq!(a.uncached_prompt_tokens, 160);
    // The first request finished: its blocks are the index's business again (no event came
    // here), and `b` wins as before.
    core.load.on_finished(&w("a"), 1);
    assert_eq!(decide(&core).worker, w("b"));
}

#[test]
fn a_placed_request_books_its_prefill_on_the_prefix_holder_and_no_prefill_on_the_decode_worker() {
    use crate::policy::PeerLink;
    use switchyard_core::{EngineKind, TierLink};
    let mut core = core(PolicyKind::Kv);
    let parent = prompt(40);
    store(&mut core, "holder", &parent, 40);
    // The holder is saturated: ten seconds of prefill queued there.
    core.load.on_routed(&w("holder"), 999, 160_000, 10, 0);
    let mut sub = parent.clone();
    sub.extend(prompt(2).iter().map(|t| t + 50_000));
    let request = route_request(&sub, bs(), None, 1);
    let link = PeerLink {
        engine: EngineKind::Vllm,
        link: TierLink {
            bytes_per_s: 10_000_000_000,
            latency_us: 100,
        },
    };
    let cands: Vec<Candidate> = candidates(&["holder", "free"])
        .into_iter()
        .map(|c| Candidate {
            kv_peer: Some(link),
            ..c
        })
        .collect();
    let (decision, mut decode) = core.route_decode(&request, &cands, 8).unwrap();
    assert_eq!(decision.worker, w("free"), "{}", decision.explanation.why);
    assert_eq!(decision.peer_source(&cands), Some(&w("holder")));
    // Booked as aggregated first: the free worker would compute only the sub-agent's own
    // blocks, the prefix being copied.
    assert_eq!(decode.uncached_prompt_tokens, 2 * u64::from(BS));

    let (prefill, source) = core.book_peer_prefill(&decision, &w("holder"), &request, &mut decode);
    assert_eq!(prefill.worker, w("holder"));
    assert_eq!(prefill.explanation.chosen, w("holder"));
    assert_eq!(source.kind, BookingKind::Prefill);
    assert_eq!(source.worker, w("holder"));
    // The holder computes what it lacks (the sub-agent's own blocks), not the prefix.
    assert_eq!(source.prefill_tokens, 2 * u64::from(BS));
    assert_eq!(decode.kind, BookingKind::DisaggregatedDecode);
    assert_eq!(booked(&core, "free")[0].prefill_tokens, 0);
    let mut on_holder: Vec<u64> = booked(&core, "holder")
        .iter()
        .map(|b| b.prefill_tokens)
        .collect();
    on_holder.sort_unstable();
    assert_eq!(on_holder, vec![2 * u64::from(BS), 160_000]);
}
