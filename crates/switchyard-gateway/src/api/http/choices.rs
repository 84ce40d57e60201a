//! The choices of one request, each its own routed generation: choice `i` of prompt `p` has
//! index `p * n + i` and, with a seed, seed + i. Each choice is admitted on its own (the first
//! with the request's permit, the others waiting in the same flow), so admission and fairness
//! count a request of n choices as n generations, and each frees its slot when it ends. Their
//! events arrive merged, tagged with the choice's index; one choice can be stopped alone (a stop
//! string matched), which aborts it on its worker.

use std::net::IpAddr;
use std::sync::Arc;

use futures::StreamExt;
use futures::stream::{BoxStream, SelectAll};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::asks::for_choice;
use super::pipeline::prepared::Prepared;
use super::state::AppState;
use crate::access::admission::{Admitted, FlowKey};
use crate::observe::audit::RequestTags;
use crate::observe::audit::tags::SessionHold;
use crate::serving::dispatch::{self, DispatchEvent, GenerateJob};
use crate::serving::sessions::{ScheduledTurn, TurnAsk};

/// The merged events of a request's choices.
pub(super) struct Choices {
    events: SelectAll<BoxStream<'static, (u32, DispatchEvent)>>,
    stops: Vec<CancellationToken>,
}

impl Choices {
    /// Starts every choice of `p`; the first runs on `permit`. `hold`: how long session
    /// scheduling held the request (its decisions show it).
    pub(super) fn start(
        state: &Arc<AppState>,
        p: &Prepared,
        permit: Admitted,
        hold: Option<SessionHold>,
    ) -> Self {
        let total = p.choices();
        let mut permit = Some(permit);
        let mut events = SelectAll::new();
        let mut stops = Vec::with_capacity(total as usize);
        for (prompt_index, prompt) in p.prompts.iter().enumerate() {
            for i in 0..p.asks.n {
                let index = prompt_index as u32 * p.asks.n + i;
                let mut sampling = for_choice(&prompt.sampling, i);
                if !sampling.ignore_eos {
                    // The model's end-of-sequence tokens, as the tokenizer names them, end the
                    // generation on any engine (the simulator has no model of its own).
                    for eos in p.model_dir.eos_token_ids() {
                        if !sampling.stop_token_ids.contains(eos) {
                            sampling.stop_token_ids.push(*eos);
                        }
                    }
                }
                let job = GenerateJob {
                    request_id: if total == 1 {
                        p.request_id.clone()
                    } else {
                        format!("{}-{index}", p.request_id)
                    },
                    tags: Arc::new(RequestTags {
                        request_id: p.request_id.clone(),
                        choice: (total > 1).then_some(index),
                        session: p.session.clone().or_else(|| p.user.clone()),
                        tenant: Some(p.flow.tenant.clone()),
                        session_source: p.session_source.map(|s| s.name()),
                        ignored_fields: p.ignored.clone(),
                        session_hold: hold,
                    }),
                    routes: Arc::clone(&p.routes),
                    prompt: prompt.tokens.clone(),
                    prompt_hashes: Some(prompt.hashes.clone()),
                    sampling,
                    identity: p.identity.clone(),
                    retention: Arc::new(state.retention.begin(p.session.as_deref())),
                    priority: p.priority,
                    session: p.session.clone().or_else(|| p.user.clone()),
                    deadline: tokio::time::Instant::from_std(
                        p.arrived + state.config.request_timeout(),
                    ),
                    max_retries: state.config.max_retries,
                    max_migrations: state.config.max_migrations,
                    disagg: state.config.disagg(),
                    span: p.span.clone(),
                };
                let stop = CancellationToken::new();
                stops.push(stop.clone());
                let run = Run {
                    state: Arc::clone(state),
                    index,
                    job: Some(job),
                    permit: permit.take(),
                    flow: p.flow.clone(),
                    client: p.client,
                    rx: None,
                    stop,
                    done: false,
                };
                events.push(run.events());
            }
        }
        Self { events, stops }
    }

    /// The next event of any choice; `None` once every choice's events have ended.
    pub(super) async fn next(&mut self) -> Option<(u32, DispatchEvent)> {
        self.events.next().await
    }

    /// Stops choice `index`: its generation is aborted and it sends nothing more.
    pub(super) fn stop(&self, index: u32) {
        if let Some(stop) = self.stops.get(index as usize) {
            stop.cancel();
        }
    }
}

/// The request's turn of its session as session scheduling lets it go (at once unless
/// scheduling is on and the session's working set does not fit): the turn's context is its
/// first prompt's first block, its size that prompt's blocks. A request without a session, or
/// whose prompt is shorter than a block, is not scheduled.
pub(super) async fn scheduled_turn(state: &Arc<AppState>, p: &Prepared) -> ScheduledTurn {
    let (Some(session), Some(prompt)) = (p.session.as_deref(), p.prompts.first()) else {
        return ScheduledTurn::default();
    };
    let Some(context) = prompt.hashes.first() else {
        return ScheduledTurn::default();
    };
    let block_size = p.routes.block_size;
    let blocks = (prompt.tokens.len() as u64).div_ceil(u64::from(block_size.get()));
    state
        .sessions
        .turn(TurnAsk {
            model: &p.routes.model,
            block_size,
            session,
            context,
            blocks,
        })
        .await
}

/// One choice: admission (unless it holds a permit), then its dispatch's events.
struct Run {
    state: Arc<AppState>,
    index: u32,
    job: Option<GenerateJob>,
    /// Held until the choice's generation ends.
    permit: Option<Admitted>,
    flow: FlowKey,
    client: Option<IpAddr>,
    rx: Option<mpsc::Receiver<DispatchEvent>>,
    stop: CancellationToken,
    done: bool,
}

impl Run {
    fn events(self) -> BoxStream<'static, (u32, DispatchEvent)> {
        futures::stream::unfold(self, |mut run| async move {
            if run.done {
                return None;
            }
            if run.rx.is_none() {
                let job = run.job.take()?;
                if run.permit.is_none() {
                    let admitted = tokio::select! {
                        admitted = run.state.admission.admit(run.flow.clone(), job.priority, run.client, &run.state.observers.metrics) => admitted,
                        () = run.stop.cancelled() => return None,
                    };
                    match admitted {
                        Ok(permit) => run.permit = Some(permit),
                        Err(err) => {
                            run.done = true;
                            return Some(((run.index, DispatchEvent::Failed(err)), run));
                        }
                    }
                }
                run.rx = Some(dispatch::start(
                    &run.state.pool,
                    &run.state.observers,
                    &run.state.transport,
                    &run.state.tasks,
                    job,
                ));
            }
            let rx = run.rx.as_mut()?;
            let event = tokio::select! {
                biased;
                // Dropping the receiver (below) aborts the generation on its worker.
                () = run.stop.cancelled() => None,
                event = rx.recv() => event,
            };
            match event {
                // Dropping `run` drops the receiver and the permit.
                None => None,
                Some(event) => {
                    if matches!(event, DispatchEvent::Finished(_) | DispatchEvent::Failed(_)) {
                        run.done = true;
                        run.rx = None;
                        run.permit = None;
                    }
                    Some(((run.index, event), run))
                }
            }
        })
        .boxed()
    }
}
