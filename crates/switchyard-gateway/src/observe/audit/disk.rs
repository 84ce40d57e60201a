//! The on-disk decision log: one JSON line per finished decision, appended by a writer thread
//! so routing never waits on the disk. The file is rotated to `<path>.1` (replacing the older
//! rotation) when it reaches half the cap, so the two files never hold more than the cap.
//! Queries read both files, oldest first, off the reactor.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use prometheus_client::metrics::counter::Counter;

/// Finished decisions waiting for the writer; more are dropped (and counted).
const QUEUE: usize = 8192;

/// Why the on-disk log cannot start.
#[derive(Debug, thiserror::Error)]
#[error("cannot open the decision log {path}: {source}")]
pub struct DiskLogError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// The writer's side of the on-disk log.
#[derive(Debug)]
pub struct DiskLog {
    path: PathBuf,
    tx: SyncSender<serde_json::Value>,
    dropped: Counter,
}

impl DiskLog {
    /// Opens (appending to) `path`, capped at `max_bytes` with its rotation; `written` and
    /// `dropped` count lines.
    pub fn open(
        path: PathBuf,
        max_bytes: u64,
        written: Counter,
        dropped: Counter,
    ) -> Result<Self, DiskLogError> {
        let file = open_append(&path).map_err(|source| DiskLogError {
            path: path.clone(),
            source,
        })?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let (tx, rx) = sync_channel(QUEUE);
        let writer = Writer {
            path: path.clone(),
            file: BufWriter::new(file),
            size,
            rotate_at: (max_bytes / 2).max(1),
            written,
            dropped: dropped.clone(),
        };
        std::thread::Builder::new()
            .name("decision-log".into())
            .spawn(move || writer.run(rx))
            .map_err(|source| DiskLogError {
                path: path.clone(),
                source,
            })?;
        Ok(Self { path, tx, dropped })
    }

    pub fn write(&self, view: serde_json::Value) {
        match self.tx.try_send(view) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.inc();
            }
        }
    }

    /// Up to `limit` logged decisions with an id below `before` that `keep` accepts, newest
    /// first.
    pub async fn read_before(
        &self,
        before: u64,
        keep: impl Fn(&serde_json::Value) -> bool + Send + 'static,
        limit: usize,
    ) -> Vec<serde_json::Value> {
        let files = [rotated(&self.path), self.path.clone()];
        let read = tokio::task::spawn_blocking(move || {
            let mut found = Vec::new();
            for file in files {
                read_matching(&file, before, &keep, &mut found);
            }
            found.reverse();
            found.truncate(limit);
            found
        });
        read.await.unwrap_or_default()
    }
}

fn rotated(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

fn open_append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// Appends the matching lines of `file` (oldest first); a missing file or an unreadable line
/// (a write cut short) is skipped.
fn read_matching(
    file: &Path,
    before: u64,
    keep: &dyn Fn(&serde_json::Value) -> bool,
    found: &mut Vec<serde_json::Value>,
) {
    let Ok(file) = File::open(file) else { return };
    for line in BufReader::new(file).lines() {
        let Ok(line) = line else { return };
        let Ok(view) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        let id = view.get("id").and_then(serde_json::Value::as_u64);
        if id.is_some_and(|id| id < before) && keep(&view) {
            found.push(view);
        }
    }
}

struct Writer {
    path: PathBuf,
    file: BufWriter<File>,
    size: u64,
    rotate_at: u64,
    written: Counter,
    dropped: Counter,
}

impl Writer {
    fn run(mut self, rx: Receiver<serde_json::Value>) {
        while let Ok(view) = rx.recv() {
            self.line(&view);
            while let Ok(view) = rx.try_recv() {
                self.line(&view);
            }
            if let Err(err) = self.file.flush() {
                tracing::warn!(path = %self.path.display(), error = %err, "cannot write the decision log");
            }
        }
    }

    fn line(&mut self, view: &serde_json::Value) {
        let mut line = view.to_string();
        line.push('\n');
        let len = line.len() as u64;
        if self.size > 0 && self.size + len > self.rotate_at && !self.rotate() {
            self.dropped.inc();
            return;
        }
        match self.file.write_all(line.as_bytes()) {
            Ok(()) => {
                self.size += len;
                self.written.inc();
            }
            Err(err) => {
                self.dropped.inc();
                tracing::warn!(path = %self.path.display(), error = %err, "cannot write the decision log");
            }
        }
    }

    /// Moves the current file to `<path>.1` and starts a new one.
    fn rotate(&mut self) -> bool {
        let moved = self
            .file
            .flush()
            .and_then(|()| std::fs::rename(&self.path, rotated(&self.path)))
            .and_then(|()| open_append(&self.path));
        match moved {
            Ok(file) => {
                self.file = BufWriter::new(file);
                self.size = 0;
                true
            }
            Err(err) => {
                tracing::warn!(path = %self.path.display(), error = %err, "cannot rotate the decision log");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::audit::decisions::DecisionQuery;

    #[tokio::test]
    async fn lines_rotate_under_the_cap_and_read_back_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let (written, dropped) = (Counter::default(), Counter::default());
        // Each line is ~60 bytes; the cap of 1000 keeps ~8 per file.
        let log = DiskLog::open(path.clone(), 1000, written.clone(), dropped.clone()).unwrap();
        for id in 1..=40u64 {
            log.write(serde_json::json!({"id": id, "request_id": format!("r{id}"), "pad": "xxxxxxxxxxxxxxxxxxxx"}));
        }
        // The writer is a thread: wait until it wrote everything.
        for _ in 0..200 {
            if written.get() == 40 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(written.get(), 40);
        assert_eq!(dropped.get(), 0);
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        assert!(size(&path) + size(&rotated(&path)) <= 1000);
        let found = log.read_before(39, |_| true, 3).await;
        let ids: Vec<u64> = found.iter().map(|v| v["id"].as_u64().unwrap()).collect();
        assert_eq!(ids, [38, 37, 36]);
        let q = DecisionQuery {
            request_id: Some("r35".into()),
            ..DecisionQuery::default()
        };
        assert_eq!(
            log.read_before(u64::MAX, move |v| q.matches(v), 10)
                .await
                .len(),
            1
        );
        // The oldest lines are gone with the older rotation.
        let q = DecisionQuery {
            request_id: Some("r1".into()),
            ..DecisionQuery::default()
        };
        assert!(
            log.read_before(u64::MAX, move |v| q.matches(v), 10)
                .await
                .is_empty()
        );
    }
}
