#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn w(id: &str) -> WorkerId {
    WorkerId::new(id).unwrap()
}

fn plan(disaggregation: Disaggregation, retries: u32, migrations: u32) -> Plan {
    Plan {
        model: "m".into(),
        settings: ServeSettings {
            disaggregation,
            min_uncached_tokens: 1000,
            ..ServeSettings::default()
        },
        max_tokens: 8,
        max_retries: retries,
        max_migrations: migrations,
        logprobs: false,
    }
}

fn routed(id: &str, uncached: u64, engine: EngineKind, needs_prefill: bool) -> Routed {
    Routed {
        worker: w(id),
        uncached_prompt_tokens: uncached,
        engine,
        needs_prefill,
        peer: None,
    }
}

fn sim(id: &str, uncached: u64) -> Routed {
    routed(id, uncached, EngineKind::Sim, false)
}

/// The sglang decode worker that serves only with a prefill worker.
fn sglang_decode(id: &str) -> Routed {
    routed(id, 16, EngineKind::Sglang, true)
}

fn route_ask(step: Step) -> RouteAsk {
    match step {
        Step::Route(ask) => ask,
        other => panic!("expected a route, got {other:?}"),
    }
}

/// Routes the next attempt on `worker` and expects aggregated generation there.
fn generate_on(s: &mut Serving, worker: Routed) -> Mode {
    let id = worker.worker.clone();
    match s.routed(Ok(worker)) {
        Step::Generate { worker, mode } => {
            assert_eq!(worker, id);
            mode
        }
        other => panic!("expected generation, got {other:?}"),
    }
}

fn failed(reason: &str) -> AttemptEnd {
    AttemptEnd::worker_failed(reason)
}

#[test]
fn failures_before_the_first_token_retry_elsewhere_until_the_limit() {
    let mut s = Serving::new(plan(Disaggregation::Off, 2, 1));
    let ask = route_ask(s.start());
    assert_eq!(
        (ask.attempt, ask.kind, ask.after),
        (1, AttemptKind::First, None)
    );
    assert!(ask.aggregated_only && !ask.prefill_pool);
    generate_on(&mut s, sim("a", 100));
    let ask = route_ask(s.ended(failed("Unavailable: gone")));
    assert_eq!(ask.after, Some(After::Retry("Unavailable: gone".into())));
    assert_eq!((ask.attempt, ask.kind), (2, AttemptKind::Retry));
    assert_eq!(ask.exclude, [w("a")]);
    generate_on(&mut s, sim("b", 100));
    route_ask(s.ended(failed("x")));
    generate_on(&mut s, sim("c", 100));
    assert_eq!(
        s.ended(failed("Internal: last")),
        Step::Fail(ServeError::Upstream(
            "3 workers failed before the first token; last: Internal: last".into()
        ))
    );
}

#[test]
fn failures_after_tokens_migrate_with_the_context_and_stop_at_max_tokens() {
    let mut p = plan(Disaggregation::Auto, 0, 2);
    p.max_tokens = 4;
    let mut s = Serving::new(p);
    assert!(route_ask(s.start()).prefill_pool);
    // A short prompt: aggregated by the threshold.
    match generate_on(&mut s, sim("a", 10)) {
        Mode::Aggregated { why, tried_prefill } => {
            assert!(why.contains("below the threshold"), "{why}");
            assert!(!tried_prefill);
        }
        other => panic!("{other:?}"),
    }
    assert!(s.mark_started());
    s.tokens(&[10, 11]);
    let ask = route_ask(s.ended(failed("Unavailable: cut")));
    assert_eq!(ask.after, Some(After::Migrate("Unavailable: cut".into())));
    assert_eq!(ask.kind, AttemptKind::Migration);
    // A migration continues on one worker: aggregated only, even with disaggregation on.
    assert!(ask.aggregated_only && !ask.prefill_pool);
    assert_eq!(ask.max_tokens, 2);
    assert_eq!(s.context(&[1, 2]), [1, 2, 10, 11]);
    let sampling = s.sampling(&Sampling {
        max_tokens: 4,
        min_tokens: Some(3),
        ..Sampling::default()
    });
    assert_eq!((sampling.max_tokens, sampling.min_tokens), (2, Some(1)));
    match generate_on(&mut s, sim("b", 10_000)) {
        Mode::Aggregated { why, .. } => assert_eq!(why, "a migration continues on one worker"),
        other => panic!("{other:?}"),
    }
    assert!(!s.mark_started(), "the consumer is told once");
    s.tokens(&[12, 13]);
    assert_eq!(s.ended(failed("x")), Step::Finish(Finish::Length));

    let mut s = Serving::new(plan(Disaggregation::Off, 0, 1));
    s.start();
    generate_on(&mut s, sim("a", 1));
    s.tokens(&[1]);
    route_ask(s.ended(failed("x")));
    generate_on(&mut s, sim("b", 1));
    assert!(matches!(
        s.ended(failed("y")),
        Step::Fail(ServeError::Upstream(m)) if m.contains("the stream failed 2 times")
    ));
}

#[test]
fn a_kv_source_fault_excludes_the_prefill_worker_and_keeps_the_decode_worker() {
    let mut s = Serving::new(plan(Disaggregation::Auto, 3, 0));
    s.start();
    assert!(matches!(
        s.routed(Ok(sim("decode", 5000))),
        Step::ChoosePrefill(_)
    ));
    assert!(matches!(
        s.prefill_picked(PrefillPick::Chosen(w("prefill"))),
        Step::Prefill { .. }
    ));
    assert_eq!(
        s.prefilled(Ok(())),
        Step::Generate {
            worker: w("decode"),
            mode: Mode::Disaggregated {
                prefill: w("prefill")
            }
        }
    );
    let ask = route_ask(s.ended(AttemptEnd::WorkerFailed {
        reason: "pull failed".into(),
        blame: Blame::KvSource,
    }));
    assert!(ask.exclude.is_empty(), "the decode worker stays eligible");
    match s.routed(Ok(sim("decode", 5000))) {
        Step::ChoosePrefill(ask) => assert_eq!(ask.exclude, [w("prefill")]),
        other => panic!("{other:?}"),
    }
    // Without a prefill worker to blame, the answering worker is.
    assert!(matches!(
        s.prefill_picked(PrefillPick::Saturated("busy".into())),
        Step::Generate {
            mode: Mode::Aggregated {
                tried_prefill: true,
                ..
            },
            ..
        }
    ));
    let ask = route_ask(s.ended(AttemptEnd::WorkerFailed {
        reason: "?".into(),
        blame: Blame::KvSource,
    }));
    assert_eq!(ask.exclude, [w("decode")]);
}

#[test]
fn done_and_a_gone_consumer_stop_and_a_refusal_fails_without_retry() {
    for (end, expected) in [
        (AttemptEnd::Done, Step::Stop),
        (AttemptEnd::ConsumerGone, Step::Stop),
        (
            AttemptEnd::Refused(ServeError::BadRequest("too long".into())),
            Step::Fail(ServeError::BadRequest("too long".into())),
        ),
    ] {
        let mut s = Serving::new(plan(Disaggregation::Off, 3, 3));
        s.start();
        generate_on(&mut s, sim("a", 1));
        assert_eq!(s.ended(end), expected);
    }
}

#[test]
fn a_prefill_that_fails_tries_another_then_falls_back_by_mode() {
    // auto: every prefill worker fails (retries + 1 tries), then aggregated on the decode
    // worker.
    let mut s = Serving::new(plan(Disaggregation::Auto, 1, 0));
    s.start();
    s.routed(Ok(sim("d", 5000)));
    s.prefill_picked(PrefillPick::Chosen(w("p1")));
    match s.prefilled(Err(PrefillFailure::Failed("p1: down".into()))) {
        Step::ChoosePrefill(ask) => {
            assert_eq!(ask.try_number, 2);
            assert_eq!(ask.exclude, [w("p1")]);
        }
        other => panic!("{other:?}"),
    }
    s.prefill_picked(PrefillPick::Chosen(w("p2")));
    match s.prefilled(Err(PrefillFailure::Failed("p2: down".into()))) {
        Step::Generate {
            worker,
            mode: Mode::Aggregated { why, tried_prefill },
        } => {
            assert_eq!(worker, w("d"));
            assert!(tried_prefill);
            assert_eq!(
                why,
                "prefill failed, falling back to aggregated; last: p2: down"
            );
        }
        other => panic!("{other:?}"),
    }
    // enforce: the same failures fail the request.
    let mut s = Serving::new(plan(Disaggregation::Enforce, 0, 0));
    s.start();
    s.routed(Ok(sim("d", 5)));
    s.prefill_picked(PrefillPick::Chosen(w("p1")));
    assert!(matches!(
        s.prefilled(Err(PrefillFailure::Failed("p1: down".into()))),
        Step::Fail(ServeError::Upstream(m)) if m.contains("1 prefill attempts failed")
    ));
    // enforce with no prefill worker: 503 naming the engine.
    let mut s = Serving::new(plan(Disaggregation::Enforce, 0, 0));
    s.start();
    s.routed(Ok(sim("d", 5)));
    assert_eq!(
        s.prefill_picked(PrefillPick::Unavailable(RouteError::NoCandidates)),
        Step::Fail(no_prefill_worker("m", EngineKind::Sim))
    );
    // A prefill worker that refuses the prompt is not retried: the decode worker computes it.
    let mut s = Serving::new(plan(Disaggregation::Auto, 3, 0));
    s.start();
    s.routed(Ok(sim("d", 5000)));
    s.prefill_picked(PrefillPick::Chosen(w("p1")));
    assert!(matches!(
        s.prefilled(Err(PrefillFailure::Refused("too long".into()))),
        Step::Generate { mode: Mode::Aggregated { why, .. }, .. }
            if why == "prefill worker p1 refused the prompt: too long"
    ));
}

#[test]
fn a_decode_worker_that_needs_a_prefill_reroutes_instead_of_falling_back() {
    // No prefill worker at all: the short prompt still tries the pool (forced), then reroutes.
    let mut s = Serving::new(plan(Disaggregation::Auto, 1, 1));
    assert!(!route_ask(s.start()).aggregated_only);
    assert!(matches!(
        s.routed(Ok(sglang_decode("sd"))),
        Step::ChoosePrefill(PrefillAsk {
            needs_prefill: true,
            engine: EngineKind::Sglang,
            ..
        })
    ));
    let ask = route_ask(s.prefill_picked(PrefillPick::Unavailable(RouteError::NoCandidates)));
    match &ask.after {
        Some(After::Reroute(why)) => {
            assert!(
                why.contains("decode worker sd (sglang, role decode)"),
                "{why}"
            );
            assert!(why.contains("no prefill worker"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        ask.aggregated_only,
        "a reroute narrows to aggregated workers"
    );
    match (&ask.note, &ask.after) {
        (Some(note), Some(After::Reroute(why))) => assert_eq!(note, why),
        other => panic!("the decision log notes the reroute: {other:?}"),
    }
    // The reroute finds nobody: a 503 that says why.
    match s.routed(Err(RouteFailure {
        error: RouteError::NoCandidates,
        needs_prefill_registered: true,
    })) {
        Step::Fail(ServeError::Unavailable(m)) => {
            assert!(m.contains("decode worker sd"), "{m}");
            assert!(
                m.contains("no worker that serves without a prefill worker"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }

    // Every prefill worker failing ends in a reroute too.
    let mut s = Serving::new(plan(Disaggregation::Auto, 0, 0));
    s.start();
    s.routed(Ok(sglang_decode("sd")));
    s.prefill_picked(PrefillPick::Chosen(w("sp")));
    let ask = route_ask(s.prefilled(Err(PrefillFailure::Failed("sp: down".into()))));
    assert!(
        matches!(&ask.after, Some(After::Reroute(why)) if why.contains("1 prefill attempts failed")),
        "{ask:?}"
    );
    // A saturated pool does not apply to it: the core never says so (see `saturation`), and
    // a pool that is found empty after failures reroutes with the last failure.
    let mut s = Serving::new(plan(Disaggregation::Auto, 1, 0));
    s.start();
    s.routed(Ok(sglang_decode("sd")));
    s.prefill_picked(PrefillPick::Chosen(w("sp")));
    s.prefilled(Err(PrefillFailure::Failed("sp: down".into())));
    let ask = route_ask(s.prefill_picked(PrefillPick::Unavailable(RouteError::NoCandidates)));
    assert!(
        matches!(&ask.after, Some(After::Reroute(why)) if why.contains("prefill failed everywhere, last: sp: down")),
        "{ask:?}"
    );
}

#[test]
fn no_candidates_explains_what_narrowed_the_choice() {
    let unavailable = |s: &mut Serving, needs: bool| match s.routed(Err(RouteFailure {
        error: RouteError::NoCandidates,
        needs_prefill_registered: needs,
    })) {
        Step::Fail(ServeError::Unavailable(m)) => m,
        other => panic!("{other:?}"),
    };
    let mut s = Serving::new(plan(Disaggregation::Off, 1, 1));
    s.start();
    assert!(unavailable(&mut s, true).contains("disaggregation is off"));
    let mut s = Serving::new(plan(Disaggregation::Auto, 1, 1));
    s.start();
    assert_eq!(
        unavailable(&mut s, false),
        "no worker is available for model `m`"
    );
    let mut logprobs = plan(Disaggregation::Auto, 1, 1);
    logprobs.logprobs = true;
    let mut s = Serving::new(logprobs);
    let ask = route_ask(s.start());
    assert!(ask.aggregated_only && !ask.prefill_pool);
    assert!(unavailable(&mut s, true).contains("log probabilities"));
    let mut s = Serving::new(plan(Disaggregation::Off, 1, 1));
    s.start();
    generate_on(&mut s, sim("a", 1));
    s.ended(failed("x"));
    assert_eq!(
        unavailable(&mut s, false),
        "no other worker is available for model `m` after 1 failed"
    );
    // Other routing errors are the router's own.
    let mut s = Serving::new(plan(Disaggregation::Off, 1, 1));
    s.start();
    assert!(matches!(
        s.routed(Err(RouteFailure {
            error: RouteError::InvalidConfig("bad".into()),
            needs_prefill_registered: false,
        })),
        Step::Fail(ServeError::Internal(_))
    ));
}

#[test]
fn outcomes_out_of_order_fail_instead_of_guessing() {
    let mut s = Serving::new(plan(Disaggregation::Auto, 1, 1));
    s.start();
    assert!(matches!(
        s.prefilled(Ok(())),
        Step::Fail(ServeError::Internal(m)) if m.contains("out of order")
    ));
    let mut s = Serving::new(plan(Disaggregation::Auto, 1, 1));
    s.start();
    assert!(matches!(
        s.ended(AttemptEnd::Done),
        Step::Fail(ServeError::Internal(_))
    ));
    let mut s = Serving::new(plan(Disaggregation::Auto, 1, 1));
    s.start();
    s.routed(Ok(sim("d", 5000)));
    assert!(matches!(
        s.prefilled(Ok(())),
        Step::Fail(ServeError::Internal(_))
    ));
}

/// A vLLM worker routed with a copy of its prefix priced from `peer` (sub-agent placement).
fn placed(id: &str, peer: &str) -> Routed {
    Routed {
        peer: Some(w(peer)),
        ..routed(id, 64, EngineKind::Vllm, false)
    }
}

#[test]
fn a_placed_request_prefills_on_the_prefix_holder_and_pulls_its_kv_whatever_the_mode() {
    for mode in [
        Disaggregation::Off,
        Disaggregation::Auto,
        Disaggregation::Enforce,
    ] {
        let mut s = Serving::new(plan(mode, 1, 1));
        s.start();
        // 64 uncached tokens, below auto's threshold: the peer is asked for all the same.
        let ask = match s.routed(Ok(placed("free", "holder"))) {
            Step::ChoosePrefill(ask) => ask,
            other => panic!("{mode:?}: expected the holder to be booked, got {other:?}"),
        };
        assert_eq!(ask.peer, Some(w("holder")));
        assert_eq!(ask.engine, EngineKind::Vllm);
        let why = match s.prefill_picked(PrefillPick::Chosen(w("holder"))) {
            Step::Prefill { worker, why, .. } => {
                assert_eq!(worker, w("holder"));
                why
            }
            other => panic!("expected the holder's prefill, got {other:?}"),
        };
        assert!(why.starts_with("placement:"), "{why}");
        assert_eq!(
            s.prefilled(Ok(())),
            Step::Generate {
                worker: w("free"),
                mode: Mode::Disaggregated {
                    prefill: w("holder")
                }
            }
        );
    }
}

#[test]
fn a_placement_whose_holder_fails_recomputes_on_the_chosen_worker() {
    // The holder's prefill fails: no prefill-pool worker is tried, the chosen worker computes.
    let mut s = Serving::new(plan(Disaggregation::Enforce, 2, 1));
    s.start();
    s.routed(Ok(placed("free", "holder")));
    s.prefill_picked(PrefillPick::Chosen(w("holder")));
    match s.prefilled(Err(PrefillFailure::Failed("holder: unavailable".into()))) {
        Step::Generate {
            worker,
            mode: Mode::Aggregated { why, tried_prefill },
        } => {
            assert_eq!(worker, w("free"));
            assert!(tried_prefill);
            assert!(why.contains("recomputing it here"), "{why}");
        }
        other => panic!("expected a local recompute, got {other:?}"),
    }
    // The pull then fails on the decode side, blamed on the source: the retry does not place
    // from that holder again.
    let ask = route_ask(s.ended(AttemptEnd::WorkerFailed {
        reason: "pull failed".into(),
        blame: Blame::KvSource,
    }));
    assert_eq!(ask.kind, AttemptKind::Retry);
    let mut s = Serving::new(plan(Disaggregation::Off, 1, 1));
    s.start();
    s.routed(Ok(placed("free", "holder")));
    s.prefill_picked(PrefillPick::Chosen(w("holder")));
    s.prefilled(Ok(()));
    route_ask(s.ended(AttemptEnd::WorkerFailed {
        reason: "pull failed".into(),
        blame: Blame::KvSource,
    }));
    assert!(
        matches!(
            s.routed(Ok(placed("free", "holder"))),
            Step::Generate {
                mode: Mode::Aggregated { .. },
                ..
            }
        ),
        "disaggregation off and the holder excluded: recomputed in place"
    );
    // A holder that cannot be booked any more (it left) is recomputed around too.
    let mut s = Serving::new(plan(Disaggregation::Auto, 1, 1));
    s.start();
    s.routed(Ok(placed("free", "holder")));
    assert!(matches!(
        s.prefill_picked(PrefillPick::Unavailable(RouteError::NoCandidates)),
        Step::Generate {
            mode: Mode::Aggregated { .. },
            ..
        }
    ));
}

#[test]
fn a_migration_or_logprobs_never_place() {
    let mut s = Serving::new(Plan {
        logprobs: true,
        ..plan(Disaggregation::Auto, 1, 1)
    });
    s.start();
    assert!(matches!(
        s.routed(Ok(placed("free", "holder"))),
        Step::Generate {
            mode: Mode::Aggregated { .. },
            ..
        }
    ));
}
