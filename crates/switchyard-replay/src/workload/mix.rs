//! A synthetic open-loop mix: a steady stream of short chat requests, which spend most of
//! their life decoding, while long prompts (16k–32k tokens by default) arrive now and then.
//! On an aggregated worker each long prompt's prefill chunks share steps with the running
//! decodes and stall them; that is the case disaggregated serving exists for.
//!
//! Arrivals are Poisson per class, lengths uniform in their ranges, all drawn from one seeded
//! generator, so the same seed gives the same requests. Chat prompts start with a shared
//! system prompt (namespace 0, ids `0..`), so prefix caching and KV-aware routing see some
//! sharing; long prompts share nothing.

use super::{Micros, Outbox, RequestSpec, Workload};
use crate::error::ReplayError;
use crate::synth::{PromptSpec, mix};

/// Tokens per hash id of the synthetic prompts.
const ID_BLOCK: u32 = 512;

/// The mix's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct MixConfig {
    /// Arrivals stop after this many seconds.
    pub seconds: f64,
    /// Chat requests per second, and their prompt and output lengths (inclusive ranges).
    pub chat_rate: f64,
    pub chat_input: (u64, u64),
    pub chat_output: (u32, u32),
    /// Shared system prompt at the start of every chat prompt, in tokens (whole 512-token
    /// blocks count).
    pub system_prompt_tokens: u64,
    /// Long prompts per second, and their prompt and output lengths.
    pub long_rate: f64,
    pub long_input: (u64, u64),
    pub long_output: (u32, u32),
    pub seed: u64,
}

impl Default for MixConfig {
    fn default() -> Self {
        Self {
            seconds: 120.0,
            chat_rate: 6.0,
            chat_input: (500, 1500),
            chat_output: (150, 450),
            system_prompt_tokens: 1024,
            long_rate: 0.25,
            long_input: (16_384, 32_768),
            long_output: (100, 300),
            seed: 1,
        }
    }
}

impl MixConfig {
    /// Scales both arrival rates (for more workers, say).
    pub fn scaled(&self, factor: f64) -> Self {
        Self {
            chat_rate: self.chat_rate * factor,
            long_rate: self.long_rate * factor,
            ..self.clone()
        }
    }

    fn validate(&self) -> Result<(), ReplayError> {
        let bad = |what: &str| Err(ReplayError::InvalidConfig(format!("mix: {what}")));
        let rate_ok = |r: f64| r.is_finite() && r >= 0.0;
        if !(self.seconds.is_finite() && self.seconds > 0.0) {
            return bad("seconds must be positive");
        }
        if !rate_ok(self.chat_rate) || !rate_ok(self.long_rate) {
            return bad("rates must be non-negative numbers");
        }
        let ranges = [self.chat_input, self.long_input];
        if ranges.iter().any(|&(lo, hi)| lo == 0 || lo > hi)
            || [self.chat_output, self.long_output]
                .iter()
                .any(|&(lo, hi)| lo == 0 || lo > hi)
        {
            return bad("length ranges must be non-empty and start at 1 or more");
        }
        Ok(())
    }
}

/// The generated requests, sent at their arrival times whatever happens to the others.
#[derive(Debug)]
pub struct MixWorkload {
    requests: Vec<(Micros, RequestSpec)>,
}

/// SplitMix64 stream over [`mix`].
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        mix(self.0)
    }
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

impl MixWorkload {
    pub fn new(config: &MixConfig) -> Result<Self, ReplayError> {
        config.validate()?;
        let mut draw = Draw(config.seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
        let mut arrivals: Vec<(f64, bool)> = Vec::new();
        for (rate, long) in [(config.chat_rate, false), (config.long_rate, true)] {
            if rate <= 0.0 {
                continue;
            }
            let mut t = -draw.unit().ln() / rate;
            while t < config.seconds {
                arrivals.push((t, long));
                t += -draw.unit().ln() / rate;
            }
        }
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
        let system_ids = (config.system_prompt_tokens / u64::from(ID_BLOCK)) as u32;
        let requests = arrivals
            .into_iter()
            .enumerate()
            .map(|(i, (t, long))| {
                let (input, output) = if long {
                    (config.long_input, config.long_output)
                } else {
                    (config.chat_input, config.chat_output)
                };
                let input_tokens = draw.between(input.0, input.1);
                let max_tokens = draw.between(u64::from(output.0), u64::from(output.1)) as u32;
                let hash_ids = if long {
                    Vec::new()
                } else {
                    (0..system_ids).collect()
                };
                let spec = RequestSpec {
                    id: i as u64,
                    prompt: PromptSpec {
                        namespace: 0,
                        block_size: ID_BLOCK,
                        hash_ids,
                        input_tokens,
                        tail_seed: config.seed ^ ((i as u64) << 20),
                    },
                    max_tokens,
                    session: None,
                };
                ((t * 1e6).round() as Micros, spec)
            })
            .collect();
        Ok(Self { requests })
    }

    pub fn requests(&self) -> &[(Micros, RequestSpec)] {
        &self.requests
    }
}

impl Workload for MixWorkload {
    fn start(&mut self, out: &mut Outbox) {
        for (at, spec) in &self.requests {
            out.send_at(*at, spec.clone());
        }
    }

    fn on_finished(&mut self, _id: u64, _ok: bool, _now: Micros, _out: &mut Outbox) {}

    fn expected_requests(&self) -> Option<u64> {
        Some(self.requests.len() as u64)
    }

    fn sessions_completed(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn same_seed_same_requests_and_lengths_in_range() {
        let config = MixConfig::default();
        let a = MixWorkload::new(&config).unwrap();
        let b = MixWorkload::new(&config).unwrap();
        assert_eq!(a.requests(), b.requests());
        let other = MixWorkload::new(&MixConfig {
            seed: 2,
            ..config.clone()
        })
        .unwrap();
        assert_ne!(a.requests(), other.requests());
        let long: Vec<_> = a
            .requests()
            .iter()
            .filter(|(_, r)| r.prompt.input_tokens >= config.long_input.0)
            .collect();
        assert!(!long.is_empty());
        for (at, r) in a.requests() {
            assert!((*at as f64) < config.seconds * 1e6);
            let input = r.prompt.input_tokens;
            assert!(
                (config.chat_input.0..=config.chat_input.1).contains(&input)
                    || (config.long_input.0..=config.long_input.1).contains(&input)
            );
        }
        assert!(
            MixWorkload::new(&MixConfig {
                chat_input: (5, 1),
                ..config
            })
            .is_err()
        );
    }
}
