//! Agent-session corpora cut by request size: the `-256k` variants of the AgentX corpora
//! (every call whose input plus output exceeds 256,000 tokens dropped) and a long-context case
//! (only the calls of at least 256k tokens kept), built from the same traces.
//!
//! A dropped call is removed from its session as the published `-256k` files remove it: the
//! next call's think time is then measured from the last call kept (and capped as usual). A
//! sub-agent with no call left is dropped, and so is a session with nothing left.

use super::weka::{WekaEntry, WekaTrace};
use crate::error::ReplayError;

/// Which calls to keep, by input plus output tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallSizes {
    /// Calls below this many tokens are dropped (0 keeps every small call).
    pub min_tokens: u64,
    /// Calls above this many tokens are dropped (`None`: no upper bound).
    pub max_tokens: Option<u64>,
}

/// What [`keep_calls`] kept and dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Kept {
    pub calls: usize,
    pub dropped_calls: usize,
    pub dropped_sessions: usize,
}

impl CallSizes {
    fn keeps(&self, tokens: u64) -> bool {
        tokens >= self.min_tokens && self.max_tokens.is_none_or(|max| tokens <= max)
    }
}

/// `traces` with only the calls `sizes` keeps; an error when the bounds are crossed or keep
/// no call at all.
pub fn keep_calls(
    traces: Vec<WekaTrace>,
    sizes: CallSizes,
) -> Result<(Vec<WekaTrace>, Kept), ReplayError> {
    if sizes.max_tokens.is_some_and(|max| max < sizes.min_tokens) {
        return Err(ReplayError::InvalidConfig(format!(
            "--truncate-tokens ({}) is below --min-call-tokens ({}): no call would be kept",
            sizes.max_tokens.unwrap_or(0),
            sizes.min_tokens
        )));
    }
    let mut kept = Kept::default();
    let mut out = Vec::with_capacity(traces.len());
    for mut trace in traces {
        let before = trace.calls();
        trace.entries.retain_mut(|entry| match entry {
            WekaEntry::Call(c) => sizes.keeps(c.input + c.output),
            WekaEntry::Subagent(s) => {
                s.calls.retain(|c| sizes.keeps(c.input + c.output));
                !s.calls.is_empty()
            }
        });
        let after = trace.calls();
        kept.dropped_calls += before - after;
        kept.calls += after;
        if after == 0 {
            kept.dropped_sessions += 1;
        } else {
            out.push(trace);
        }
    }
    if out.is_empty() {
        return Err(ReplayError::InvalidConfig(format!(
            "no call of the traces has between {} and {} tokens (input + output)",
            sizes.min_tokens,
            sizes
                .max_tokens
                .map_or_else(|| "any number of".to_owned(), |m| m.to_string())
        )));
    }
    Ok((out, kept))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::weka::{WekaCall, WekaSubagent};

    fn call(input: u64, output: u64) -> WekaCall {
        WekaCall {
            t: 0.0,
            input,
            output,
            hash_ids: vec![1],
            api_time: 0.0,
        }
    }

    fn trace(id: &str, entries: Vec<WekaEntry>) -> WekaTrace {
        WekaTrace {
            id: id.into(),
            block_size: 64,
            entries,
        }
    }

    fn corpus() -> Vec<WekaTrace> {
        vec![
            trace(
                "a",
                vec![
                    WekaEntry::Call(call(100_000, 500)),
                    WekaEntry::Call(call(255_500, 500)), // exactly 256,000: kept by -256k
                    WekaEntry::Subagent(WekaSubagent {
                        t: 0.0,
                        agent_id: "s".into(),
                        is_async: false,
                        calls: vec![call(300_000, 10), call(20_000, 10)],
                    }),
                    WekaEntry::Call(call(600_000, 100)),
                ],
            ),
            trace("b", vec![WekaEntry::Call(call(900_000, 100))]),
        ]
    }

    #[test]
    fn the_256k_cut_drops_calls_above_it_and_sessions_left_empty() {
        let sizes = CallSizes {
            min_tokens: 0,
            max_tokens: Some(256_000),
        };
        let (traces, kept) = keep_calls(corpus(), sizes).unwrap();
        assert_eq!(
            kept,
            Kept {
                calls: 3,
                dropped_calls: 3,
                dropped_sessions: 1
            }
        );
        assert_eq!(traces.len(), 1);
        let a = &traces[0];
        assert_eq!(a.entries.len(), 3);
        let WekaEntry::Subagent(s) = &a.entries[2] else {
            panic!("the sub-agent keeps its small call")
        };
        assert_eq!(s.calls, vec![call(20_000, 10)]);
    }

    #[test]
    fn the_long_context_case_keeps_only_long_calls() {
        let sizes = CallSizes {
            min_tokens: 262_144,
            max_tokens: None,
        };
        let (traces, kept) = keep_calls(corpus(), sizes).unwrap();
        assert_eq!((kept.calls, kept.dropped_calls), (3, 3));
        let sizes: Vec<u64> = traces
            .iter()
            .flat_map(|t| &t.entries)
            .flat_map(|e| match e {
                WekaEntry::Call(c) => vec![c.input],
                WekaEntry::Subagent(s) => s.calls.iter().map(|c| c.input).collect(),
            })
            .collect();
        assert_eq!(sizes, vec![300_000, 600_000, 900_000]);
    }

    #[test]
    fn bounds_that_keep_nothing_are_refused() {
        let crossed = CallSizes {
            min_tokens: 10,
            max_tokens: Some(5),
        };
        let err = keep_calls(corpus(), crossed).unwrap_err().to_string();
        assert!(err.contains("--truncate-tokens"), "{err}");
        let none = CallSizes {
            min_tokens: 2_000_000,
            max_tokens: None,
        };
        assert!(keep_calls(corpus(), none).is_err());
    }
}
