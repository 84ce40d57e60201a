//! Workloads: what to send and when, independent of where it is sent.
//!
//! A [`Workload`] is a state machine the driver (the offline [`crate::cluster`] in virtual
//! time, or the [`crate::live`] HTTP driver in wall-clock time) feeds with completions; it
//! answers with requests to send at given times through an [`Outbox`]. So open-loop traces
//! ([`mooncake`]) and closed-loop agent sessions ([`weka`]) run unchanged in both modes.

pub mod mix;
pub mod mooncake;
pub mod weka;
pub mod weka_filter;

use crate::synth::PromptSpec;

/// Microseconds since the replay started (virtual or wall-clock).
pub type Micros = u64;

/// One request a workload wants sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSpec {
    /// Unique within the replay.
    pub id: u64,
    pub prompt: PromptSpec,
    /// `max_tokens`; sent with `ignore_eos` so exactly this many tokens come back.
    pub max_tokens: u32,
    /// Session the request belongs to (agent session instance), for session-aware routing.
    pub session: Option<String>,
}

/// Requests a workload asks the driver to send, each at a time not before now, and the
/// sessions it has finished with (no turn of theirs will come again).
#[derive(Debug, Default)]
pub struct Outbox {
    sends: Vec<(Micros, RequestSpec)>,
    ended: Vec<String>,
}

impl Outbox {
    pub fn send_at(&mut self, at: Micros, request: RequestSpec) {
        self.sends.push((at, request));
    }

    /// Takes the queued sends in the order they were queued.
    pub fn drain(&mut self) -> std::vec::Drain<'_, (Micros, RequestSpec)> {
        self.sends.drain(..)
    }

    pub fn is_empty(&self) -> bool {
        self.sends.is_empty()
    }

    /// Session `session` (as in [`RequestSpec::session`]) sends nothing more.
    pub fn end_session(&mut self, session: String) {
        self.ended.push(session);
    }

    /// Takes the sessions ended since the last call, in the order they ended.
    pub fn drain_ended(&mut self) -> std::vec::Drain<'_, String> {
        self.ended.drain(..)
    }
}

/// A workload driven by completions.
pub trait Workload: std::fmt::Debug {
    /// Called once, at time 0.
    fn start(&mut self, out: &mut Outbox);

    /// Request `id` finished (or failed: `ok == false`) at `now`.
    fn on_finished(&mut self, id: u64, ok: bool, now: Micros, out: &mut Outbox);

    /// Requests the workload will send in total, if known up front (for progress bars).
    fn expected_requests(&self) -> Option<u64>;

    /// Sessions fully completed so far (0 for open-loop traces).
    fn sessions_completed(&self) -> u64;
}
