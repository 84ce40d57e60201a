//! A coverage-less mutational fuzzer: the bounded fuzz run of the test command.
//!
//! libFuzzer (`fuzz/run.sh`) is the real fuzzer, guided by coverage, but its instrumented build
//! of the whole dependency tree costs more than the test command can spend on it
//! (`fuzz/README.md` has the measurements). This runs the same targets, built with the rest of
//! the workspace, on mutations of the committed seeds and regressions: byte flips, interesting
//! values, insertions, deletions, duplications and splices of two inputs, a few at a time. It
//! finds what lies a few mutations from a seed, and keeps the targets exercised on every run.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use switchyard_core::rng::SplitMix64;

use crate::Target;

/// Inputs are kept at most this long (as libFuzzer's `-max_len` in `fuzz/run.sh`).
pub const MAX_LEN: usize = 16_384;

/// What one bounded run of a target did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub runs: u64,
    pub elapsed: Duration,
    /// The first input that panicked, if one did.
    pub crash: Option<Vec<u8>>,
}

/// Runs `target` on mutations of `seeds` until `budget` has passed or an input panics.
/// The same `seed` gives the same inputs in the same order.
pub fn fuzz(target: &Target, seeds: &[Vec<u8>], budget: Duration, seed: u64) -> Outcome {
    let started = Instant::now();
    let mut rng = SplitMix64::new(seed);
    let fallback = [Vec::new()];
    let seeds = if seeds.is_empty() {
        &fallback[..]
    } else {
        seeds
    };
    let mut runs = 0;
    // The seeds themselves first, then mutations.
    let mut queue = seeds.iter().cloned();
    while started.elapsed() < budget {
        let input = queue.next().unwrap_or_else(|| mutant(&mut rng, seeds));
        runs += 1;
        if catch_unwind(AssertUnwindSafe(|| (target.run)(&input))).is_err() {
            return Outcome {
                runs,
                elapsed: started.elapsed(),
                crash: Some(input),
            };
        }
    }
    Outcome {
        runs,
        elapsed: started.elapsed(),
        crash: None,
    }
}

/// A seed changed by one to eight mutations.
pub fn mutant(rng: &mut SplitMix64, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut data = seeds[rng.below(seeds.len())].clone();
    let steps = 1 + rng.below(8);
    for _ in 0..steps {
        mutate(rng, &mut data, seeds);
    }
    data.truncate(MAX_LEN);
    data
}

const INTERESTING: [u8; 10] = [0x00, 0x01, 0x7f, 0x80, 0xff, 0xc0, 0xcf, 0x90, b'"', b'{'];

fn mutate(rng: &mut SplitMix64, data: &mut Vec<u8>, seeds: &[Vec<u8>]) {
    let len = data.len();
    match rng.below(8) {
        // Flip one bit.
        0 if len > 0 => {
            let at = rng.below(len);
            data[at] ^= 1 << rng.below(8);
        }
        // An interesting byte (MessagePack markers, JSON punctuation, edges).
        1 if len > 0 => {
            let at = rng.below(len);
            data[at] = INTERESTING[rng.below(INTERESTING.len())];
        }
        // A random byte.
        2 if len > 0 => {
            let at = rng.below(len);
            data[at] = rng.next_u64() as u8;
        }
        // Insert a few random bytes.
        3 => {
            let at = rng.below(len + 1);
            let n = 1 + rng.below(8);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            data.splice(at..at, bytes);
        }
        // Delete a range.
        4 if len > 0 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(32));
            data.drain(at..at + n);
        }
        // Duplicate a range in place (repeated events, nested structures).
        5 if len > 0 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(64));
            let copy = data[at..at + n].to_vec();
            data.splice(at..at, copy);
        }
        // Splice: a piece of another seed over the tail.
        6 => {
            let other = &seeds[rng.below(seeds.len())];
            if !other.is_empty() {
                let from = rng.below(other.len());
                let at = rng.below(len + 1);
                data.truncate(at);
                data.extend_from_slice(&other[from..]);
            }
        }
        // An interesting integer, big-endian, over four or eight bytes.
        _ if len >= 8 => {
            let at = rng.below(len - 7);
            let value: u64 = match rng.below(4) {
                0 => u64::MAX,
                1 => u64::MAX - 1,
                2 => 1 << 63,
                _ => u64::from(u32::MAX),
            };
            data[at..at + 8].copy_from_slice(&value.to_be_bytes());
        }
        _ => data.push(rng.next_u64() as u8),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panics_on_fuzz(data: &[u8]) {
        assert!(!data.windows(4).any(|w| w == b"FUZZ"), "found");
    }

    #[test]
    fn finds_an_input_a_few_mutations_from_a_seed_and_is_reproducible() {
        let target = Target {
            name: "test",
            run: panics_on_fuzz,
        };
        let seeds = vec![b"FUZx and more".to_vec(), b"other".to_vec()];
        let a = fuzz(&target, &seeds, Duration::from_secs(60), 7);
        let crash = a.crash.expect("a crash within the budget");
        assert!(crash.windows(4).any(|w| w == b"FUZZ"));
        let b = fuzz(&target, &seeds, Duration::from_secs(60), 7);
        assert_eq!((b.runs, b.crash), (a.runs, Some(crash)));
    }

    #[test]
    fn mutants_stay_within_the_length_bound() {
        let mut rng = SplitMix64::new(1);
        let seeds = vec![vec![0xaa; MAX_LEN]];
        for _ in 0..200 {
            assert!(mutant(&mut rng, &seeds).len() <= MAX_LEN);
        }
    }
}
