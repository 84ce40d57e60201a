//! The KV-event recorder: every input the router sees, appended to a JSON Lines file on demand.
//!
//! While a recording runs, the gateway hands each input to [`Recorder::record`] at the moment it
//! applies it, still holding the model's routing lock, so the file's order is the order the
//! router saw: workers joining and leaving, KV events and snapshots applied to the
//! `PrefixIndex`, load reports and in-flight bookkeeping fed to the `LoadView`, and every
//! routing request with its candidates and the live decision. `switchyard replay events`
//! rebuilds the router from such a file and asks other policies what they would have chosen.
//! The format is documented in `docs/kv-recording.md`.
//!
//! The routing path never waits on the disk: records go through a bounded channel to a writer
//! on a blocking thread, which serialises and writes them. When the channel is full the record
//! is dropped and counted, and the recording is marked incomplete. When the recording is off,
//! a hook costs one relaxed atomic load.
//!
//! Starting a recording asks every worker's event stream for a fresh snapshot (see
//! [`Recorder::resync_requests`]), so the file begins from the workers' full cache state rather
//! than from whatever events happen to follow.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::time::Instant;

use serde::Serialize;
use switchyard_router::Tick;
pub use switchyard_router::recording::{
    FORMAT, Header, PrefillRecord, Record, RouteRecord, ServedAs, Trailer, VERSION,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

/// Records waiting for the writer before new ones are dropped.
pub const DEFAULT_CHANNEL_CAPACITY: usize = 65_536;

/// Why a recording could not start or stop. All are the operator's to fix; retrying the same
/// call cannot help (except [`RecordingError::AlreadyRecording`], once the other one stops).
#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("the recording to {0} has not been stopped")]
    AlreadyRecording(PathBuf),
    #[error("no recording is running")]
    NotRecording,
    #[error("recording path refused: {0}")]
    PathRefused(String),
    #[error("cannot write recording {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the recording writer failed: {0}")]
    Writer(String),
}

/// How much a recording may hold and how far the writer may fall behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_records: Option<u64>,
    pub max_bytes: Option<u64>,
    pub channel_capacity: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_records: None,
            max_bytes: None,
            channel_capacity: DEFAULT_CHANNEL_CAPACITY,
        }
    }
}

/// What a recording holds, for the status and stop responses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RecordingStatus {
    pub active: bool,
    pub path: Option<PathBuf>,
    /// Records written to the file so far (header and trailer not counted).
    pub records: u64,
    /// Records lost because the writer fell behind; any makes the recording incomplete.
    pub dropped: u64,
    /// Bytes written so far.
    pub bytes: u64,
    /// Whether every input since the start is in the file (no record dropped).
    pub complete: bool,
    /// Set once the recording ended: `stopped`, `max_records`, `max_bytes`, `shutdown` or
    /// `error`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_by: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Default)]
struct Counters {
    written: AtomicU64,
    dropped: AtomicU64,
    bytes: AtomicU64,
    /// The gateway is shutting down (rather than an admin stopping the recording).
    shutdown: AtomicBool,
    ended_by: Mutex<Option<&'static str>>,
    error: Mutex<Option<String>>,
}

impl Counters {
    fn end(&self, why: &'static str) {
        let mut ended = self.ended_by.lock().unwrap_or_else(|p| p.into_inner());
        ended.get_or_insert(why);
    }
}

#[derive(Debug)]
struct Session {
    path: PathBuf,
    tx: mpsc::Sender<Record>,
    counters: Arc<Counters>,
    writer: JoinHandle<()>,
}

/// The gateway's one recorder; see the module docs.
#[derive(Debug)]
pub struct Recorder {
    /// Mirrors "a session is running and accepts records"; the writer clears it at a limit.
    active: Arc<AtomicBool>,
    session: RwLock<Option<Session>>,
    resync_tx: watch::Sender<u64>,
    /// The router clock's zero (the pool's), so records carry the router's own ticks.
    epoch: Instant,
}

impl Recorder {
    pub fn new(epoch: Instant) -> Self {
        Self {
            active: Arc::new(AtomicBool::new(false)),
            session: RwLock::new(None),
            resync_tx: watch::Sender::new(0),
            epoch,
        }
    }

    /// Microseconds since the router clock's zero.
    pub fn now_tick(&self) -> Tick {
        self.epoch.elapsed().as_micros() as Tick
    }

    /// Whether records are being taken; the hooks check this before building a record.
    #[inline]
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Appends the record `make` builds, if a recording runs. Never waits: a full channel drops
    /// the record and counts it.
    #[inline]
    pub fn record(&self, make: impl FnOnce() -> Record) {
        if self.is_active() {
            self.push(make());
        }
    }

    fn push(&self, record: Record) {
        let session = self.session.read().unwrap_or_else(|p| p.into_inner());
        let Some(session) = session.as_ref() else {
            return;
        };
        if let Err(mpsc::error::TrySendError::Full(_)) = session.tx.try_send(record) {
            session.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Changes whenever a recording starts: each worker's event subscriber then asks its worker
    /// for a fresh snapshot, which lands in the recording as its starting state.
    pub fn resync_requests(&self) -> watch::Receiver<u64> {
        self.resync_tx.subscribe()
    }

    /// Starts recording to `path` (created; an existing file is never overwritten). The writer
    /// thread is tracked by `tasks`.
    pub fn start(
        &self,
        path: PathBuf,
        header: &Header,
        limits: Limits,
        tasks: &TaskTracker,
    ) -> Result<RecordingStatus, RecordingError> {
        let mut slot = self.session.write().unwrap_or_else(|p| p.into_inner());
        // A recording that ended at a limit still needs its stop call (which reports it).
        if let Some(running) = slot.as_ref() {
            return Err(RecordingError::AlreadyRecording(running.path.clone()));
        }
        let io = |source| RecordingError::Io {
            path: path.clone(),
            source,
        };
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io)?;
        let mut out = BufWriter::new(file);
        let mut line = header_line(header).map_err(|e| RecordingError::Writer(e.to_string()))?;
        line.push('\n');
        out.write_all(line.as_bytes()).map_err(io)?;
        let counters = Arc::new(Counters::default());
        counters.bytes.store(line.len() as u64, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(limits.channel_capacity.max(1));
        let writer = {
            let counters = Arc::clone(&counters);
            let active = Arc::clone(&self.active);
            let path = path.clone();
            tasks.spawn_blocking(move || write_records(rx, out, &path, limits, &counters, &active))
        };
        *slot = Some(Session {
            path: path.clone(),
            tx,
            counters,
            writer,
        });
        self.active.store(true, Ordering::Relaxed);
        drop(slot);
        self.resync_tx.send_modify(|epoch| *epoch += 1);
        tracing::info!(path = %path.display(), "kv recording started");
        Ok(self.status())
    }

    /// Stops the recording: what is queued is written, then the trailer; returns the totals.
    pub async fn stop(&self) -> Result<RecordingStatus, RecordingError> {
        self.active.store(false, Ordering::Relaxed);
        let session = self
            .session
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some(session) = session else {
            return Err(RecordingError::NotRecording);
        };
        let Session {
            path,
            tx,
            counters,
            writer,
        } = session;
        drop(tx);
        writer
            .await
            .map_err(|e| RecordingError::Writer(e.to_string()))?;
        let status = status_of(false, &path, &counters);
        tracing::info!(path = %path.display(), records = status.records, dropped = status.dropped, "kv recording stopped");
        Ok(status)
    }

    /// Ends a running recording without waiting (gateway shutdown); the writer thread, tracked
    /// by the pool's tasks, writes what is queued and the trailer.
    pub fn close(&self) {
        self.active.store(false, Ordering::Relaxed);
        let session = self
            .session
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(session) = session {
            session.counters.shutdown.store(true, Ordering::Relaxed);
        }
    }

    /// The running (or last ended-by-limit) recording's figures.
    pub fn status(&self) -> RecordingStatus {
        let session = self.session.read().unwrap_or_else(|p| p.into_inner());
        match session.as_ref() {
            Some(s) => status_of(
                self.is_active() && !s.writer.is_finished(),
                &s.path,
                &s.counters,
            ),
            None => RecordingStatus {
                active: false,
                path: None,
                records: 0,
                dropped: 0,
                bytes: 0,
                complete: true,
                ended_by: None,
                error: None,
            },
        }
    }
}

fn status_of(active: bool, path: &Path, counters: &Counters) -> RecordingStatus {
    let dropped = counters.dropped.load(Ordering::Relaxed);
    RecordingStatus {
        active,
        path: Some(path.to_owned()),
        records: counters.written.load(Ordering::Relaxed),
        dropped,
        bytes: counters.bytes.load(Ordering::Relaxed),
        complete: dropped == 0,
        ended_by: if active {
            None
        } else {
            *counters.ended_by.lock().unwrap_or_else(|p| p.into_inner())
        },
        error: counters
            .error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
    }
}

fn header_line(header: &Header) -> Result<String, serde_json::Error> {
    serde_json::to_string(&Record::Header(header.clone()))
}

/// The writer thread: serialises records until the channel closes or a limit is reached, then
/// writes the trailer. Records arriving after a limit are discarded (the file stays a
/// consistent prefix of the router's input).
fn write_records(
    mut rx: mpsc::Receiver<Record>,
    mut out: BufWriter<File>,
    path: &Path,
    limits: Limits,
    counters: &Counters,
    active: &AtomicBool,
) {
    let mut writing = true;
    let fail = |counters: &Counters, err: String| {
        tracing::warn!(path = %path.display(), error = %err, "kv recording failed");
        *counters.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(err);
        counters.end("error");
        active.store(false, Ordering::Relaxed);
    };
    while let Some(record) = rx.blocking_recv() {
        if !writing {
            continue;
        }
        let line = match serde_json::to_string(&record) {
            Ok(mut line) => {
                line.push('\n');
                line
            }
            Err(err) => {
                fail(counters, err.to_string());
                writing = false;
                continue;
            }
        };
        let bytes = counters.bytes.load(Ordering::Relaxed) + line.len() as u64;
        if limits.max_bytes.is_some_and(|max| bytes > max) {
            counters.end("max_bytes");
            active.store(false, Ordering::Relaxed);
            writing = false;
            continue;
        }
        if let Err(err) = out.write_all(line.as_bytes()) {
            fail(counters, err.to_string());
            writing = false;
            continue;
        }
        counters.bytes.store(bytes, Ordering::Relaxed);
        let written = counters.written.fetch_add(1, Ordering::Relaxed) + 1;
        if limits.max_records.is_some_and(|max| written >= max) {
            counters.end("max_records");
            active.store(false, Ordering::Relaxed);
            writing = false;
        }
    }
    // A limit or an error, if one ended the recording earlier, stays the reason.
    counters.end(if counters.shutdown.load(Ordering::Relaxed) {
        "shutdown"
    } else {
        "stopped"
    });
    let ended_by = counters
        .ended_by
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .unwrap_or("stopped");
    if ended_by == "error" {
        return;
    }
    let dropped = counters.dropped.load(Ordering::Relaxed);
    let trailer = Record::Trailer(Trailer {
        records: counters.written.load(Ordering::Relaxed),
        dropped,
        complete: dropped == 0,
        ended_by: ended_by.to_owned(),
    });
    let result = serde_json::to_string(&trailer)
        .map_err(|e| e.to_string())
        .and_then(|mut line| {
            line.push('\n');
            out.write_all(line.as_bytes())
                .and_then(|()| out.flush())
                .map_err(|e| e.to_string())
                .map(|()| line.len() as u64)
        });
    match result {
        Ok(len) => {
            counters.bytes.fetch_add(len, Ordering::Relaxed);
        }
        Err(err) => fail(counters, err),
    }
}

#[cfg(test)]
mod tests;
