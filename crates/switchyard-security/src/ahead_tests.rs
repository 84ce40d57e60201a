use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};

use http_body::{Body as _, Frame};
use tonic::Status;
use tonic::body::Body;

use super::{Ahead, Data};

/// A body shaped like tonic's encoder: it learns it has ended only when polled after its
/// last frame, and until `open` is set it is not ready after its first `ready` frames.
struct Encoder {
    frames: VecDeque<&'static str>,
    ready: usize,
    open: Arc<AtomicBool>,
    ended: bool,
}

impl http_body::Body for Encoder {
    type Data = Data;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Data>, Status>>> {
        if self.ready == 0 && !self.open.load(Ordering::SeqCst) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.ready = self.ready.saturating_sub(1);
        match self.frames.pop_front() {
            Some(text) => Poll::Ready(Some(Ok(Frame::data(Data::from_static(text.as_bytes()))))),
            None => {
                self.ended = true;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

fn encoder(frames: &[&'static str], ready: usize) -> (Body, Arc<AtomicBool>) {
    let open = Arc::new(AtomicBool::new(false));
    let body = Encoder {
        frames: frames.iter().copied().collect(),
        ready,
        open: Arc::clone(&open),
        ended: false,
    };
    (Body::new(body), open)
}

fn next(body: &mut Ahead) -> Poll<Option<String>> {
    let mut cx = Context::from_waker(Waker::noop());
    Pin::new(body).poll_frame(&mut cx).map(|frame| {
        frame.map(|frame| {
            let data = frame.expect("no error").into_data().expect("a data frame");
            String::from_utf8(data.to_vec()).expect("utf-8")
        })
    })
}

#[test]
fn a_unary_body_ends_with_its_only_message() {
    let (body, _) = encoder(&["message"], usize::MAX);
    assert!(
        !body.is_end_stream(),
        "the encoder does not know it has ended"
    );
    let mut ahead = Ahead::read(body);
    assert!(!ahead.is_end_stream());
    assert_eq!(ahead.size_hint().exact(), Some(7));
    assert_eq!(next(&mut ahead), Poll::Ready(Some("message".into())));
    assert!(
        ahead.is_end_stream(),
        "the end is known with the last message, so it goes out in the same DATA frame"
    );
    assert_eq!(next(&mut ahead), Poll::Ready(None));
}

#[test]
fn a_body_not_ready_is_read_on_from_where_it_stopped() {
    let (body, open) = encoder(&["one", "two", "three"], 1);
    let mut ahead = Ahead::read(body);
    assert_eq!(next(&mut ahead), Poll::Ready(Some("one".into())));
    assert!(!ahead.is_end_stream());
    assert_eq!(next(&mut ahead), Poll::Pending);
    open.store(true, Ordering::SeqCst);
    assert_eq!(next(&mut ahead), Poll::Ready(Some("two".into())));
    assert_eq!(next(&mut ahead), Poll::Ready(Some("three".into())));
    assert_eq!(next(&mut ahead), Poll::Ready(None));
    assert!(ahead.is_end_stream());
}

#[test]
fn a_long_stream_is_read_ahead_only_so_far() {
    let frames = ["a", "b", "c", "d", "e", "f"];
    let (body, _) = encoder(&frames, usize::MAX);
    let mut ahead = Ahead::read(body);
    assert_eq!(ahead.frames.len(), super::MAX_FRAMES_AHEAD);
    for frame in frames {
        assert_eq!(next(&mut ahead), Poll::Ready(Some(frame.into())));
    }
    assert_eq!(next(&mut ahead), Poll::Ready(None));
}

#[test]
fn an_empty_body_stays_empty() {
    let mut ahead = Ahead::read(Body::empty());
    assert!(ahead.is_end_stream());
    assert_eq!(ahead.size_hint().exact(), Some(0));
    assert_eq!(next(&mut ahead), Poll::Ready(None));
}
