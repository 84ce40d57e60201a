//! gRPC request bodies read ahead, so a call's last frame carries the end of the stream.
//!
//! A tonic client body (an encoder over a stream of messages) does not know it has ended until
//! it is polled once more after its last message, so the HTTP/2 client sends that message in a
//! DATA frame and then an empty DATA frame with END_STREAM, often in a write of its own: on a
//! unary or server-streaming call (every `Generate`) one socket write in three for nothing.
//! [`ReadAhead`] polls the body as far as it is ready before handing the request on (a unary
//! body is ready at once: its message is already encoded), so the client sees the end with the
//! last message. A body that is not ready (a client stream still producing) is passed on
//! from where the read stopped, polled as before.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use http_body::{Body as _, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;

type Data = <Body as http_body::Body>::Data;

/// Frames read ahead at most per request: a unary body has one.
const MAX_FRAMES_AHEAD: usize = 4;

/// A service whose requests' bodies are read ahead ([module docs](self)).
#[derive(Debug, Clone)]
pub struct ReadAhead<S> {
    inner: S,
}

impl<S> ReadAhead<S> {
    pub fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S> tower::Service<http::Request<Body>> for ReadAhead<S>
where
    S: tower::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let body = Body::new(Ahead::read(body));
        self.inner.call(http::Request::from_parts(parts, body))
    }
}

/// A body with the frames that were ready when the request was sent, then the rest.
struct Ahead {
    frames: VecDeque<Result<Frame<Data>, Status>>,
    /// The body from where the read stopped; `None` once it has ended.
    rest: Option<Body>,
}

impl Ahead {
    fn read(mut body: Body) -> Self {
        let mut frames = VecDeque::new();
        // Nothing waits on this poll: a body that is not ready is polled again, with the
        // sender's waker, when the client asks for its next frame.
        let mut cx = Context::from_waker(Waker::noop());
        let rest = loop {
            if body.is_end_stream() {
                break None;
            }
            if frames.len() == MAX_FRAMES_AHEAD {
                break Some(body);
            }
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(frame)) => frames.push_back(frame),
                Poll::Ready(None) => break None,
                Poll::Pending => break Some(body),
            }
        };
        Self { frames, rest }
    }
}

impl http_body::Body for Ahead {
    type Data = Data;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Data>, Status>>> {
        if let Some(frame) = self.frames.pop_front() {
            return Poll::Ready(Some(frame));
        }
        match &mut self.rest {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let ahead: u64 = self
            .frames
            .iter()
            .filter_map(|frame| frame.as_ref().ok()?.data_ref())
            .map(|data| data.len() as u64)
            .sum();
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint);
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(ahead));
        }
        hint.set_lower(rest.lower().saturating_add(ahead));
        hint
    }
}

#[cfg(test)]
#[path = "ahead_tests.rs"]
mod tests;
