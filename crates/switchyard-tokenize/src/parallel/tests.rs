//! Parallel tokenization against one pass: same ids and starts for random texts cut into
//! many small pieces, with the built-in cl100k and with Qwen3 (`fetch-test-models.sh`).

use std::sync::Arc;

use proptest::prelude::*;

use super::{CoreBudget, ParallelPlan, encode_with_starts_within};
use crate::Tokenizer;
use crate::error::TokenizeError;

/// Small pieces so that short random texts are cut many times.
const PLAN: ParallelPlan = ParallelPlan {
    workers: 6,
    min_piece_bytes: 16,
};

const FRAGMENTS: &[&str] = &[
    "the",
    " quick",
    " fox",
    "Hello",
    "'s",
    "'ll",
    "don't",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\n\n",
    "0",
    "42",
    "12345",
    ".",
    ",",
    "...",
    "->",
    "{",
    "}",
    "();",
    "你好",
    "世界",
    "，",
    "。",
    "日本語",
    "café",
    "e\u{301}",
    "🦀",
    "👨\u{200d}👩\u{200d}👧",
    "\u{a0}",
    "\u{3000}",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "fn main() {\n    x();\n}",
];

fn text_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        6 => proptest::sample::select(FRAGMENTS).prop_map(str::to_owned),
        1 => any::<char>().prop_map(String::from),
        1 => (proptest::sample::select(FRAGMENTS), 2usize..30).prop_map(|(f, n)| f.repeat(n)),
    ];
    proptest::collection::vec(piece, 0..120).prop_map(|parts| parts.concat())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap()
}

/// A budget of its own for one call, with a core for every piece of [`PLAN`].
fn budget(cores: usize) -> &'static CoreBudget {
    Box::leak(Box::new(CoreBudget::new(cores)))
}

/// Runs `encode_with_starts_within` on the runtime's blocking pool, as the gateway does.
fn parallel(
    rt: &tokio::runtime::Runtime,
    tok: &Arc<Tokenizer>,
    text: &str,
    max: usize,
) -> Result<(Vec<u32>, Vec<u32>), TokenizeError> {
    parallel_within(rt, tok, text, max, budget(PLAN.workers))
}

fn parallel_within(
    rt: &tokio::runtime::Runtime,
    tok: &Arc<Tokenizer>,
    text: &str,
    max: usize,
    budget: &'static CoreBudget,
) -> Result<(Vec<u32>, Vec<u32>), TokenizeError> {
    let (tok, text) = (Arc::clone(tok), text.to_owned());
    rt.block_on(
        rt.spawn_blocking(move || {
            encode_with_starts_within(&tok, &text, max, &PLAN, budget).result
        }),
    )
    .unwrap()
}

/// Waits until the helpers, which may still be returning after the caller is done, have given
/// their cores back.
fn settled(budget: &CoreBudget) -> usize {
    for _ in 0..1000 {
        if budget.busy() == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    budget.busy()
}

fn check(tok: Tokenizer) {
    let tok = Arc::new(tok);
    let rt = runtime();
    let cut = std::cell::Cell::new(0usize);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 300,
        ..ProptestConfig::default()
    });
    runner
        .run(&text_strategy(), |text| {
            let want = tok.encode_with_starts(&text).unwrap();
            prop_assert_eq!(parallel(&rt, &tok, &text, usize::MAX).unwrap(), want);
            cut.set(cut.get() + usize::from(PLAN.pieces(&tok, &text).len() > 1));
            Ok(())
        })
        .unwrap();
    let cut = cut.get();
    assert!(cut > 100, "only {cut} of 300 texts were cut into pieces");
}

#[test]
fn builtin_pieces_join_to_one_pass() {
    check(Tokenizer::builtin_cl100k());
}

#[test]
fn qwen3_pieces_join_to_one_pass() {
    check(Tokenizer::from_hf_file(&crate::fast::exact_tests::qwen3_json()).unwrap());
}

#[test]
fn a_long_text_is_cut_near_equal_parts_at_clean_splits() {
    let tok = Tokenizer::builtin_cl100k();
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(10_000);
    let plan = ParallelPlan {
        workers: 4,
        min_piece_bytes: 32 << 10,
    };
    let ranges = plan.pieces(&tok, &text);
    assert_eq!(ranges.len(), 4);
    assert_eq!(ranges[0].0, 0);
    assert_eq!(ranges[3].1, text.len());
    for pair in ranges.windows(2) {
        assert_eq!(pair[0].1, pair[1].0);
        assert!(tok.seam_rules().clean_split(text.as_bytes(), pair[0].1));
    }
    for &(from, to) in &ranges {
        assert!((to - from).abs_diff(text.len() / 4) < 64, "{from}..{to}");
    }
}

#[test]
fn the_token_limit_holds() {
    let tok = Arc::new(Tokenizer::builtin_cl100k());
    let rt = runtime();
    let text = "word ".repeat(2_000);
    let count = tok.encode(&text).unwrap().len();
    assert_eq!(parallel(&rt, &tok, &text, count).unwrap().0.len(), count);
    match parallel(&rt, &tok, &text, count - 1) {
        Err(TokenizeError::TooManyTokens { at_least, max }) => {
            assert_eq!((at_least, max), (count, count - 1));
        }
        other => panic!("expected TooManyTokens, got {other:?}"),
    }
}

#[test]
fn without_a_runtime_the_text_is_tokenized_in_one_pass() {
    let tok = Arc::new(Tokenizer::builtin_cl100k());
    let text = "word ".repeat(2_000);
    let got = encode_with_starts_within(&tok, &text, usize::MAX, &PLAN, budget(6));
    assert_eq!(got.result.unwrap(), tok.encode_with_starts(&text).unwrap());
}

/// With every blocking thread busy (here: the one there is, running the caller) the helpers
/// never start, and the caller tokenizes every piece itself instead of waiting for them.
#[test]
fn a_full_blocking_pool_does_not_stall_it() {
    let tok = Arc::new(Tokenizer::builtin_cl100k());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(1)
        .build()
        .unwrap();
    let text = "Some words, 123 and more. ".repeat(500);
    let want = tok.encode_with_starts(&text).unwrap();
    assert!(PLAN.pieces(&tok, &text).len() > 2);
    let got = parallel(&rt, &tok, &text, usize::MAX).unwrap();
    assert_eq!(got, want);
}

#[test]
fn a_reservation_takes_only_free_cores_and_gives_them_back() {
    let budget = CoreBudget::new(4);
    let me = budget.occupy();
    assert_eq!(budget.busy(), 1);
    let mut helpers = budget.reserve(5);
    assert_eq!(helpers.threads(), 3);
    assert_eq!(budget.reserve(1).threads(), 0);
    let one = helpers.take_one().unwrap();
    assert_eq!((one.threads(), helpers.threads()), (1, 2));
    drop(helpers);
    assert_eq!(budget.busy(), 2);
    assert_eq!(budget.reserve(9).threads(), 2);
    drop((one, me));
    assert_eq!(budget.busy(), 0);
    // The caller counts even past the capacity: it runs anyway.
    let all: Vec<_> = (0..6).map(|_| budget.occupy()).collect();
    assert_eq!(budget.busy(), 6);
    assert_eq!(budget.reserve(1).threads(), 0);
    drop(all);
    assert_eq!(budget.busy(), 0);
}

/// Two long texts at once on two cores: each takes one pass, since neither has a free core
/// for a helper; alone, a text is cut over both cores. The result is the same either way.
#[test]
fn a_text_is_cut_only_while_cores_are_free() {
    let tok = Arc::new(Tokenizer::builtin_cl100k());
    let rt = runtime();
    let text = "Some words, 123 and more. ".repeat(500);
    let want = tok.encode_with_starts(&text).unwrap();
    let two = budget(2);

    let other = two.occupy();
    assert_eq!(
        parallel_within(&rt, &tok, &text, usize::MAX, two).unwrap(),
        want
    );
    assert_eq!((two.split_texts(), two.whole_for_busy_cores()), (0, 1));
    assert_eq!(
        two.busy(),
        1,
        "only the other tokenization is still counted"
    );
    drop(other);

    assert_eq!(
        parallel_within(&rt, &tok, &text, usize::MAX, two).unwrap(),
        want
    );
    assert_eq!((two.split_texts(), two.whole_for_busy_cores()), (1, 1));
    assert_eq!(settled(two), 0, "a helper kept its core");
}
