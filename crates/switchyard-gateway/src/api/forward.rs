//! The `/v1` middleware that serves a session's turn at its owner replica.
//!
//! A POST with an `x-session-id` whose owner is another replica is sent there whole (method,
//! path, headers but the hop-by-hop ones, body) with [`FORWARDED_HEADER`], and the owner's
//! answer (a JSON body or an event stream) is streamed back as it comes. A turn that already
//! carries the header is served here, never forwarded again, once its credential checks out.
//! When the owner cannot be reached (connection refused or timed out before it answered) the
//! turn is served here and counted; the owner is set aside until the registry lists it again.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderName, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::cluster::fleet::{FORWARDED_HEADER, Fleet, ForwardLabels};
use crate::error::ApiError;

/// Serves `request` at its session's owner when that is another replica, else here.
pub async fn forward_session(
    State(fleet): State<Arc<Fleet>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    if let Some(credential) = request.headers().get(FORWARDED_HEADER) {
        let accepted = credential.to_str().is_ok_and(|c| fleet.accepts(c));
        if !accepted {
            tracing::warn!("a forwarded request without a valid cluster credential was refused");
            return ApiError::Unauthorized.into_response();
        }
        fleet.metrics.fleet.received.inc();
        return next.run(request).await;
    }
    let session = crate::api::http::pipeline::session_of(request.headers());
    let Some(owner) = session.and_then(|s| fleet.other_owner(&s)) else {
        return next.run(request).await;
    };
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, fleet.body_limit).await {
        Ok(body) => body,
        Err(_) => return ApiError::PayloadTooLarge(fleet.body_limit).into_response(),
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut outgoing = fleet
        .client
        .post(format!("http://{}{path}", owner.address))
        .body(body.clone());
    for (name, value) in &parts.headers {
        if !is_hop_by_hop(name) {
            outgoing = outgoing.header(name, value);
        }
    }
    outgoing = outgoing.header(FORWARDED_HEADER, fleet.credential());
    let started = Instant::now();
    match outgoing.send().await {
        Ok(answer) => {
            fleet
                .metrics
                .fleet
                .forward_seconds
                .observe(started.elapsed().as_secs_f64());
            count(&fleet, "forwarded");
            relay(answer)
        }
        Err(error) => {
            tracing::warn!(owner = %owner.id, address = %owner.address, %error, "session owner unreachable; serving the turn here");
            count(&fleet, "owner_unreachable");
            fleet.set_aside(&owner);
            next.run(Request::from_parts(parts, Body::from(body))).await
        }
    }
}

fn count(fleet: &Fleet, outcome: &'static str) {
    fleet
        .metrics
        .fleet
        .forwarded
        .get_or_create(&ForwardLabels { outcome })
        .inc();
}

/// The owner's answer as this replica's: status, end-to-end headers, the body as it streams.
fn relay(answer: reqwest::Response) -> Response {
    let mut response = Response::builder().status(answer.status());
    if let Some(headers) = response.headers_mut() {
        for (name, value) in answer.headers() {
            if !is_hop_by_hop(name) && name != header::CONTENT_LENGTH {
                headers.append(name, value.clone());
            }
        }
    }
    response
        .body(Body::from_stream(answer.bytes_stream()))
        .unwrap_or_else(|e| {
            ApiError::Internal(format!("cannot relay the owner's answer: {e}")).into_response()
        })
}

/// Headers that belong to one connection, not to the request (RFC 9110 §7.6.1), plus the
/// host, which names this replica, and the length, which the client recomputes.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}
