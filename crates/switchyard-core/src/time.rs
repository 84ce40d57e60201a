//! Wall-clock time as it travels between processes.

use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch by this machine's clock (0 if the clock is set before it).
pub fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Seconds from `then` (Unix microseconds, from [`unix_micros`], maybe another machine's) to
/// `now`; 0 when `then` is later (clocks of different machines disagree).
pub fn seconds_since(then: u64, now: u64) -> f64 {
    now.saturating_sub(then) as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elapsed_is_never_negative() {
        assert_eq!(seconds_since(2_500_000, 1_000_000), 0.0);
        assert_eq!(seconds_since(1_000_000, 3_500_000), 2.5);
        assert!(unix_micros() > 1_600_000_000_000_000);
    }
}
