//! Log probabilities in OpenAI's shapes, built from what the engine reported per token
//! ([`TokenLogprob`]) and the text of each token.
//!
//! - Chat: `choices[].logprobs.content[]`, one entry per token with its `token` text, `logprob`,
//!   `bytes` and `top_logprobs` (as many as the request's `top_logprobs`).
//! - Text completions: `choices[].logprobs` with parallel lists `tokens`, `token_logprobs`,
//!   `top_logprobs` (per token a map of the `logprobs` most likely tokens plus the generated
//!   one) and `text_offset` (where each token's text starts in the choice's text).
//!
//! A token's text is the token decoded alone (special tokens included); `bytes` are that text's
//! UTF-8 bytes, so a token that is part of a multi-byte character shows U+FFFD.

use std::collections::BTreeMap;

use serde::Serialize;
use switchyard_core::{TokenId, TokenLogprob};

/// One alternative of a chat token.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One token of a chat choice.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// `choices[].logprobs` of a chat completion (and of each streamed chunk).
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    /// Always `null`: refusals are not generated apart from content.
    pub refusal: Option<Vec<ChatTokenLogprob>>,
}

/// `choices[].logprobs` of a text completion (and of each streamed chunk).
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    pub text_offset: Vec<u32>,
}

/// A choice's log probabilities in one of the two shapes, as they accumulate.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum LogprobsOut {
    Chat(ChatLogprobs),
    Text(CompletionLogprobs),
}

impl LogprobsOut {
    /// An empty one in the shape of `chat` or text completions.
    pub fn new(chat: bool) -> Self {
        if chat {
            LogprobsOut::Chat(ChatLogprobs::default())
        } else {
            LogprobsOut::Text(CompletionLogprobs::default())
        }
    }

    /// Appends `entries`, naming each token with `text_of`. `offset` is where the next token's
    /// text starts in the choice's text (characters); it is advanced past each token.
    pub fn push(
        &mut self,
        entries: &[TokenLogprob],
        text_of: &dyn Fn(TokenId) -> String,
        offset: &mut u32,
    ) {
        match self {
            LogprobsOut::Chat(chat) => {
                for e in entries {
                    let token = text_of(e.token);
                    chat.content.push(ChatTokenLogprob {
                        bytes: token.as_bytes().to_vec(),
                        token,
                        logprob: e.logprob,
                        top_logprobs: e
                            .top
                            .iter()
                            .map(|t| {
                                let token = text_of(t.token);
                                ChatTopLogprob {
                                    bytes: token.as_bytes().to_vec(),
                                    token,
                                    logprob: t.logprob,
                                }
                            })
                            .collect(),
                    });
                }
            }
            LogprobsOut::Text(text) => {
                for e in entries {
                    let token = text_of(e.token);
                    let mut top = BTreeMap::new();
                    // The generated token is always there, as OpenAI's legacy API has it; two
                    // tokens of the same text keep the likelier figure.
                    for (t, lp) in std::iter::once((e.token, e.logprob))
                        .chain(e.top.iter().map(|t| (t.token, t.logprob)))
                    {
                        let entry = top.entry(text_of(t)).or_insert(lp);
                        *entry = entry.max(lp);
                    }
                    text.text_offset.push(*offset);
                    *offset = offset.saturating_add(token.chars().count() as u32);
                    text.tokens.push(token);
                    text.token_logprobs.push(e.logprob);
                    text.top_logprobs.push(top);
                }
            }
        }
    }

    /// Takes what accumulated so far, leaving an empty one of the same shape (a stream sends
    /// each chunk's own).
    pub fn take(&mut self) -> LogprobsOut {
        let empty = LogprobsOut::new(matches!(self, LogprobsOut::Chat(_)));
        std::mem::replace(self, empty)
    }

    pub fn is_empty(&self) -> bool {
        match self {
            LogprobsOut::Chat(c) => c.content.is_empty(),
            LogprobsOut::Text(t) => t.tokens.is_empty(),
        }
    }
}

#[cfg(test)]
mod tests {
    use switchyard_core::TopLogprob;

    use super::*;

    fn entry(token: TokenId, logprob: f32, top: &[(TokenId, f32)]) -> TokenLogprob {
        TokenLogprob {
            token,
            logprob,
            top: top
                .iter()
                .map(|&(token, logprob)| TopLogprob { token, logprob })
                .collect(),
        }
    }

    fn name(t: TokenId) -> String {
        match t {
            1 => "é".into(),
            _ => format!("t{t}"),
        }
    }

    #[test]
    fn chat_entries_carry_text_bytes_and_the_alternatives_in_order() {
        let mut out = LogprobsOut::new(true);
        let mut offset = 0;
        out.push(
            &[entry(1, -0.5, &[(2, -0.25), (1, -0.5)])],
            &name,
            &mut offset,
        );
        let LogprobsOut::Chat(chat) = out.take() else {
            panic!("chat shape")
        };
        assert_eq!(chat.content[0].token, "é");
        assert_eq!(chat.content[0].bytes, vec![0xc3, 0xa9]);
        let tops: Vec<&str> = chat.content[0]
            .top_logprobs
            .iter()
            .map(|t| t.token.as_str())
            .collect();
        assert_eq!(tops, ["t2", "é"]);
        assert!(out.is_empty(), "take leaves an empty one");
        let json = serde_json::to_value(&chat).unwrap();
        assert!(json["refusal"].is_null());
    }

    #[test]
    fn text_entries_have_offsets_and_the_generated_token_among_the_top() {
        let mut out = LogprobsOut::new(false);
        let mut offset = 5;
        out.push(
            &[entry(3, -1.0, &[(4, -0.5)]), entry(10, -0.1, &[])],
            &name,
            &mut offset,
        );
        let LogprobsOut::Text(text) = out else {
            panic!("text shape")
        };
        assert_eq!(text.tokens, ["t3", "t10"]);
        assert_eq!(text.token_logprobs, [-1.0, -0.1]);
        assert_eq!(text.text_offset, [5, 7]);
        assert_eq!(offset, 10);
        assert_eq!(
            text.top_logprobs[0],
            BTreeMap::from([("t3".to_owned(), -1.0), ("t4".to_owned(), -0.5)])
        );
        assert_eq!(text.top_logprobs[1].len(), 1);
    }
}
