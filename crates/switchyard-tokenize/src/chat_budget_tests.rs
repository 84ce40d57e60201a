//! The render budget: templates that loop or build huge strings end with
//! [`TokenizeError::TemplateBudget`]; real templates use a small part of it at every size.

use super::*;
use crate::Fault;
use crate::builtin::BUILTIN_CHAT_TEMPLATE;

fn conversation(turns: usize, words_per_message: usize) -> ChatRequest {
    let text = "lorem ipsum ".repeat(words_per_message / 2);
    let messages = (0..turns)
        .flat_map(|i| {
            [
                ChatMessage::text("user", format!("question {i}: {text}")),
                ChatMessage::text("assistant", format!("answer {i}: {text}")),
            ]
        })
        .chain([ChatMessage::text("user", "and now?")])
        .collect();
    ChatRequest::new(messages)
}

/// The fuel `template` needs to render `request`, to within 2% (binary search), or `None` when
/// not even the whole budget of the request's size is enough.
fn fuel_needed(template: &ChatTemplate, request: &ChatRequest) -> Option<u64> {
    let budget = render_fuel(request);
    template.render_with_fuel(request, budget).ok()?;
    let (mut low, mut high) = (0, budget);
    while high - low > high / 50 {
        let mid = low + (high - low) / 2;
        match template.render_with_fuel(request, mid) {
            Ok(_) => high = mid,
            Err(TokenizeError::TemplateBudget { .. }) => low = mid,
            Err(other) => panic!("{other}"),
        }
    }
    Some(high)
}

/// Qwen3's template, as its `tokenizer_config.json` ships it.
const QWEN3_TEMPLATE: &str = include_str!("../tests/fixtures/qwen3_chat_template.jinja");

fn builtin_template() -> ChatTemplate {
    ChatTemplate::new(BUILTIN_CHAT_TEMPLATE, None, Some("<|im_end|>".into())).unwrap()
}

#[test]
fn a_template_that_loops_ends_with_a_budget_error() {
    let template = ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let err = template
        .render(&conversation(1, 10))
        .expect_err("the loop must not finish");
    assert!(
        matches!(err, TokenizeError::TemplateBudget { fuel, .. } if fuel == render_fuel(&conversation(1, 10))),
        "{err}"
    );
    assert_eq!(err.fault(), Fault::ModelFiles);
    assert!(err.to_string().contains("budget"), "{err}");
}

#[test]
fn a_template_that_builds_a_huge_string_ends_with_a_budget_error() {
    // 100 MB per repetition, a thousand times over.
    let template = ChatTemplate::new(
        "{% set ns = namespace(s='') %}{% for i in range(1000) %}{% set ns.s = ns.s ~ ('x' * 100000000) %}{% endfor %}{{ ns.s | length }}",
        None,
        None,
    )
    .unwrap();
    let err = template.render(&conversation(1, 10)).unwrap_err();
    assert!(matches!(err, TokenizeError::TemplateBudget { .. }), "{err}");
}

#[test]
fn real_templates_use_a_small_part_of_the_budget_at_every_size() {
    let templates = [
        ("built-in", builtin_template()),
        (
            "qwen3",
            ChatTemplate::new(QWEN3_TEMPLATE, None, Some("<|im_end|>".into())).unwrap(),
        ),
    ];
    for (name, template) in &templates {
        // Short and long conversations of long and of short messages.
        for (turns, words) in [(1, 10), (10, 200), (50, 1000), (2000, 0)] {
            let request = conversation(turns, words);
            let bytes = request.approx_len();
            let needed = fuel_needed(template, &request).expect("a real template fits");
            let budget = render_fuel(&request);
            eprintln!("{name}: {turns} turns, {bytes} bytes: {needed} fuel of {budget}");
            assert!(
                needed * 10 <= budget,
                "{name}, {turns} turns, {bytes} bytes: {needed} fuel needed of a {budget} budget"
            );
        }
    }
}
