//! Sub-agent placement's booking: when the decode decision priced copying the prompt's prefix
//! from a peer ([`RoutedRequest::peer`]), that peer is booked as the request's prefill worker
//! (it prefills the prompt, hitting its cache, and the decode worker pulls the KV through the
//! engines' disaggregated path) instead of one chosen from the prefill pool. The serving
//! core books it ([`ServingCore::book_peer_prefill`](switchyard_router::serve::ServingCore::book_peer_prefill));
//! this file supplies the gateway's inputs, the decision log and the recording, as
//! [`super::route_prefill`] does for the pool.

use std::sync::Arc;

use switchyard_core::WorkerId;
use switchyard_router::serve::RescoreBasis;
use switchyard_router::{RouteError, RouteRequest};

use super::{PrefillRoute, RoutedRequest, Stage, cached_blocks, routed_on, write_route};
use crate::cluster::pool::{ModelRoutes, WorkerPool};
use crate::observe::Observers;
use crate::observe::audit::{DecisionEntry, RequestTags};
use crate::observe::recorder::{PrefillRecord, ServedAs};

/// What a placement's booking is asked: the attempt's request, the peer holding its prefix,
/// and the request its decisions are logged under.
#[derive(Debug, Clone, Copy)]
pub struct PeerRouteAsk<'a> {
    pub request: &'a RouteRequest,
    pub source: &'a WorkerId,
    pub tags: &'a Arc<RequestTags>,
}

/// Books `ask.source` as `decode`'s KV source, makes `decode`'s booking disaggregated, and logs
/// the prefill decision (a note says it is a placement). Unavailable when the source left,
/// drains or stopped answering since the decision: the decode worker then recomputes.
pub fn route_peer(
    pool: &WorkerPool,
    observers: &Observers,
    routes: &Arc<ModelRoutes>,
    ask: PeerRouteAsk<'_>,
    decode: &mut RoutedRequest,
) -> PrefillRoute {
    let PeerRouteAsk {
        request,
        source,
        tags,
    } = ask;
    let Some(worker) = pool.worker(source) else {
        return PrefillRoute::Unavailable(RouteError::NoCandidates);
    };
    if worker.is_draining() || !worker.health.is_answering() {
        return PrefillRoute::Unavailable(RouteError::NoCandidates);
    }
    let (decision, booking, basis) = {
        let mut core = routes.lock();
        let (decision, booking) =
            core.serving
                .book_peer_prefill(&decode.decision, source, request, &mut decode.booking);
        let basis =
            RescoreBasis::capture(request, &decision, &core.serving.index, &core.serving.load);
        if let Some(record) = decode.pending.take() {
            let prefill = PrefillRecord {
                key: Some(booking.key),
                candidates: vec![source.clone()],
                chosen: Some(source.clone()),
                cached_blocks: cached_blocks(&decision),
            };
            write_route(
                &observers.recorder,
                record,
                ServedAs::Disaggregated,
                Some(prefill),
            );
        }
        (Arc::new(decision), booking, basis)
    };
    let note = format!(
        "placement: {source} holds the prompt's prefix; {} pulls its KV instead of recomputing it",
        decode.worker_id
    );
    let audit = observers.decisions.push(
        DecisionEntry::new(
            Arc::clone(tags),
            routes.model.clone(),
            routes.block_size.get(),
            1,
            Stage::Prefill,
            Arc::clone(&decision),
            Some(note),
        )
        .with_basis(basis),
    );
    PrefillRoute::Routed(routed_on(
        observers, routes, worker, decision, booking, audit,
    ))
}
