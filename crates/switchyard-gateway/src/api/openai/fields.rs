//! The outcome of each chat and text-completion field outside the sampling fields
//! (`docs/openai-api.md` has the table): the template switches and the session key are
//! honoured, the fields that cannot change the tokens are advisory, the few whose absence a
//! client would notice are refused by name, and the rest are unknown (the policy in
//! [`crate::api::http::fields`] decides).

use std::collections::BTreeMap;

use serde_json::Value as Json;

use crate::api::http::fields::{
    FieldNotes, Reasoning, SessionSource, session_key, template_kwargs,
};
use crate::error::ApiError;

/// Fields that cannot change the tokens a request gets: accepted, recorded, counted.
const ADVISORY: [&str; 13] = [
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    // Predicted output: a speculative-decoding hint; it never changes the tokens sampled.
    "prediction",
    "verbosity",
    // Disaggregation is the gateway's to decide: it sets each engine's own transfer fields.
    "kv_transfer_params",
    // Hosted search: the model answers without it.
    "web_search_options",
    "prompt_cache_retention",
    "request_id",
    "parallel_tool_calls_hint",
    "stream_obfuscation",
    "user_id",
];

/// Which endpoint's body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// Notes the fields of a chat or completion body that [`super::SamplingFields`] does not hold.
/// `logprobs` says whether the request asked for log probabilities (which
/// `return_tokens_as_token_ids` would rename).
pub fn notes_of(
    endpoint: Endpoint,
    rest: &BTreeMap<String, Json>,
    logprobs: bool,
) -> Result<FieldNotes, ApiError> {
    let mut notes = FieldNotes::default();
    for (field, value) in rest.iter().filter(|(_, v)| !v.is_null()) {
        let bad = |why: &str| ApiError::bad_param(field.clone(), format!("`{field}`: {why}"));
        match (endpoint, field.as_str()) {
            (Endpoint::Chat, "chat_template_kwargs") => {
                notes.template_kwargs = template_kwargs(value, field)?;
            }
            (Endpoint::Chat, "reasoning_effort") => {
                let reasoning = value.as_str().and_then(Reasoning::of_effort).ok_or_else(|| {
                    bad("must be \"none\", \"minimal\", \"low\", \"medium\", \"high\" or \"xhigh\"")
                })?;
                notes.ask_reasoning(reasoning, "reasoning_effort");
            }
            (Endpoint::Chat, "add_generation_prompt") => {
                notes.add_generation_prompt =
                    Some(value.as_bool().ok_or_else(|| bad("expected a boolean"))?);
            }
            (Endpoint::Chat, "continue_final_message") => match value {
                Json::Bool(false) => {}
                Json::Bool(true) => {
                    return Err(bad(
                        "continuing the last assistant message is not supported: the chat template closes it",
                    ));
                }
                _ => return Err(bad("expected a boolean")),
            },
            (Endpoint::Chat, "modalities") => {
                let only_text = value
                    .as_array()
                    .is_some_and(|m| m.iter().all(|x| x == "text"));
                if !only_text {
                    return Err(bad(
                        "only [\"text\"] is served: the models behind this gateway write text",
                    ));
                }
            }
            (Endpoint::Chat, "audio") => {
                return Err(bad(
                    "audio output is not served: the models behind this gateway write text",
                ));
            }
            (Endpoint::Chat, "functions" | "function_call") => {
                return Err(bad(
                    "the legacy function-calling fields are not served; use `tools` and `tool_choice`",
                ));
            }
            (Endpoint::Completions, "suffix") => {
                if value.as_str().is_some_and(|s| !s.is_empty()) {
                    return Err(bad("inserting text before a suffix is not served"));
                }
            }
            (_, "prompt_cache_key") => {
                let key = value.as_str().ok_or_else(|| bad("expected a string"))?;
                if let Some(key) = session_key(key) {
                    notes.session = Some((SessionSource::PromptCacheKey, key));
                }
            }
            (_, "return_tokens_as_token_ids") => match value {
                Json::Bool(false) => {}
                Json::Bool(true) if !logprobs => notes.advisory(field.clone()),
                Json::Bool(true) => {
                    return Err(bad(
                        "log probabilities name their tokens by text here, not as token_id:N",
                    ));
                }
                _ => return Err(bad("expected a boolean")),
            },
            // Scheduling priority: carried to the workers (docs/engines.md, "Request priority").
            (_, "priority") => notes.note_priority(field, value)?,
            (_, "truncate_prompt_tokens") => {
                return Err(bad(
                    "the gateway does not truncate prompts: a prompt over the context is a 400",
                ));
            }
            (_, name) if ADVISORY.contains(&name) => notes.advisory(field.clone()),
            _ => notes.unknown(field.clone()),
        }
    }
    Ok(notes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rest(body: Json) -> BTreeMap<String, Json> {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn what_agent_clients_send_every_day_is_accepted() {
        let notes = notes_of(
            Endpoint::Chat,
            &rest(json!({
                "chat_template_kwargs": {"enable_thinking": false},
                "reasoning_effort": "high", "metadata": {"a": "b"}, "store": false,
                "service_tier": "auto", "prompt_cache_key": "sess-1",
                "safety_identifier": "u", "priority": 5, "prediction": {"type": "content"},
                "verbosity": "low", "modalities": ["text"], "add_generation_prompt": true,
                "continue_final_message": false, "return_tokens_as_token_ids": false,
                "kv_transfer_params": {"do_remote_decode": true}, "brand_new": 1
            })),
            false,
        )
        .unwrap();
        assert_eq!(notes.template_kwargs["enable_thinking"], Json::Bool(false));
        assert_eq!(notes.reasoning(), Reasoning::of_effort("high"));
        assert_eq!(
            notes.session,
            Some((SessionSource::PromptCacheKey, "sess-1".to_owned()))
        );
        assert_eq!(notes.add_generation_prompt, Some(true));
        // The priority is carried to the workers, not dropped as advisory.
        assert_eq!(notes.priority, Some(5));
        assert_eq!(notes.unknown_names().collect::<Vec<_>>(), ["brand_new"]);
        assert_eq!(
            notes.ignored(),
            [
                "brand_new",
                "kv_transfer_params",
                "metadata",
                "prediction",
                "safety_identifier",
                "service_tier",
                "store",
                "verbosity"
            ]
        );
    }

    #[test]
    fn what_would_change_the_answer_is_refused_by_name() {
        for (body, param) in [
            (
                json!({"continue_final_message": true}),
                "continue_final_message",
            ),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
            (json!({"audio": {"voice": "x"}}), "audio"),
            (json!({"functions": []}), "functions"),
            (json!({"reasoning_effort": "extreme"}), "reasoning_effort"),
            (json!({"chat_template_kwargs": "x"}), "chat_template_kwargs"),
            (
                json!({"truncate_prompt_tokens": 5}),
                "truncate_prompt_tokens",
            ),
        ] {
            let Err(ApiError::BadRequest {
                param: Some(named), ..
            }) = notes_of(Endpoint::Chat, &rest(body.clone()), false)
            else {
                panic!("{body} is refused");
            };
            assert_eq!(named, param);
        }
        let tokens = rest(json!({"return_tokens_as_token_ids": true}));
        assert!(notes_of(Endpoint::Chat, &tokens, true).is_err());
        assert!(notes_of(Endpoint::Chat, &tokens, false).is_ok());
        let suffix = rest(json!({"suffix": "end"}));
        assert!(notes_of(Endpoint::Completions, &suffix, false).is_err());
        // A chat-only switch on a text completion is just unknown.
        let notes = notes_of(
            Endpoint::Completions,
            &rest(json!({"reasoning_effort": "low"})),
            false,
        )
        .unwrap();
        assert_eq!(
            notes.unknown_names().collect::<Vec<_>>(),
            ["reasoning_effort"]
        );
    }

    #[test]
    fn a_priority_is_an_integer_carried_on_both_endpoints_and_anything_else_is_a_400_naming_it() {
        for endpoint in [Endpoint::Chat, Endpoint::Completions] {
            for (value, want) in [
                (json!(-20), -20),
                (json!(0), 0),
                (json!(i32::MAX), i32::MAX),
            ] {
                let notes = notes_of(endpoint, &rest(json!({"priority": value})), false).unwrap();
                assert_eq!(notes.priority, Some(want));
                assert!(notes.ignored().is_empty(), "{:?}", notes.ignored());
            }
            // null is "not sent".
            let notes = notes_of(endpoint, &rest(json!({"priority": null})), false).unwrap();
            assert_eq!(notes.priority, None);
            for bad in [
                json!(1.5),
                json!("high"),
                json!(true),
                json!([1]),
                json!(i64::from(i32::MAX) + 1),
                json!(u64::MAX),
            ] {
                let Err(ApiError::BadRequest {
                    param: Some(named),
                    message,
                    ..
                }) = notes_of(endpoint, &rest(json!({"priority": bad})), false)
                else {
                    panic!("priority {bad} is refused");
                };
                assert_eq!(named, "priority");
                assert!(message.contains("integer"), "{message}");
            }
        }
    }
}
