use super::*;
use switchyard_core::WorkerId;
use switchyard_router::PolicyConfig;

fn header() -> Header {
    Header {
        format: FORMAT.to_owned(),
        version: VERSION,
        gateway_version: "test".to_owned(),
        started_at_unix_ms: 0,
        start_tick: 0,
        policy: "kv".to_owned(),
        policy_settings: PolicyConfig::default(),
        serve: Default::default(),
        workers: Vec::new(),
        max_records: None,
        max_bytes: None,
    }
}

fn finished(key: u64) -> Record {
    Record::Finished {
        tick: key,
        model: "m".into(),
        key,
        worker: Some(WorkerId::new("w").unwrap()),
    }
}

/// A fresh path in the system temp directory (no tempfile dependency in this crate).
fn temp_path() -> PathBuf {
    use std::sync::atomic::AtomicUsize;
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "switchyard-recorder-test-{}-{n}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&path);
    path
}

fn lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test]
async fn records_are_written_in_order_between_header_and_trailer() {
    let path = temp_path();
    let recorder = Recorder::new(Instant::now());
    let tasks = TaskTracker::new();
    let resync = recorder.resync_requests();
    // Off: the closure is not even called.
    recorder.record(|| unreachable!("not recording"));
    recorder
        .start(path.clone(), &header(), Limits::default(), &tasks)
        .unwrap();
    assert!(
        resync.has_changed().unwrap(),
        "subscribers are asked to resync"
    );
    assert!(matches!(
        recorder.start(path.clone(), &header(), Limits::default(), &tasks),
        Err(RecordingError::AlreadyRecording(_))
    ));
    for key in 0..100 {
        recorder.record(|| finished(key));
    }
    let status = recorder.stop().await.unwrap();
    assert_eq!(status.records, 100);
    assert_eq!(status.dropped, 0);
    assert!(status.complete);
    assert_eq!(status.ended_by, Some("stopped"));
    let lines = lines(&path);
    assert_eq!(lines.len(), 102);
    assert_eq!(lines[0]["type"], "header");
    assert_eq!(lines[0]["format"], FORMAT);
    for (i, line) in lines[1..101].iter().enumerate() {
        assert_eq!(line["type"], "finished");
        assert_eq!(line["key"], i as u64);
    }
    assert_eq!(lines[101]["type"], "trailer");
    assert_eq!(lines[101]["complete"], true);
    assert_eq!(status.bytes, std::fs::metadata(&path).unwrap().len());
    assert!(matches!(
        recorder.stop().await,
        Err(RecordingError::NotRecording)
    ));
    // An existing file is never overwritten.
    assert!(matches!(
        recorder.start(path, &header(), Limits::default(), &tasks),
        Err(RecordingError::Io { .. })
    ));
}

#[tokio::test]
async fn a_full_channel_drops_and_counts_and_marks_the_recording_incomplete() {
    let path = temp_path();
    let recorder = Recorder::new(Instant::now());
    // A session whose writer has not run yet: the channel fills and the rest is dropped.
    let (tx, rx) = mpsc::channel(4);
    let counters = Arc::new(Counters::default());
    *recorder.session.write().unwrap() = Some(Session {
        path: path.clone(),
        tx,
        counters: Arc::clone(&counters),
        writer: tokio::spawn(async {}),
    });
    recorder.active.store(true, Ordering::Relaxed);
    for key in 0..10 {
        recorder.record(|| finished(key));
    }
    assert_eq!(recorder.status().dropped, 6);
    assert!(!recorder.status().complete);
    // The writer then writes what was queued, in order, and a trailer saying what was lost.
    recorder.close();
    let out = BufWriter::new(File::create(&path).unwrap());
    let (p, c) = (path.clone(), Arc::clone(&counters));
    tokio::task::spawn_blocking(move || {
        write_records(rx, out, &p, Limits::default(), &c, &AtomicBool::new(false));
    })
    .await
    .unwrap();
    let lines = lines(&path);
    let keys: Vec<u64> = lines[..4]
        .iter()
        .map(|l| l["key"].as_u64().unwrap())
        .collect();
    assert_eq!(keys, [0, 1, 2, 3]);
    assert_eq!(lines[4]["type"], "trailer");
    assert_eq!(lines[4]["dropped"], 6);
    assert_eq!(lines[4]["complete"], false);
    assert_eq!(lines[4]["ended_by"], "shutdown");
}

#[tokio::test]
async fn a_record_limit_ends_the_recording_with_a_consistent_prefix() {
    let path = temp_path();
    let recorder = Recorder::new(Instant::now());
    let limits = Limits {
        max_records: Some(5),
        ..Limits::default()
    };
    recorder
        .start(path.clone(), &header(), limits, &TaskTracker::new())
        .unwrap();
    for key in 0..20 {
        recorder.record(|| finished(key));
    }
    let status = recorder.stop().await.unwrap();
    assert_eq!(status.records, 5);
    assert_eq!(status.ended_by, Some("max_records"));
    let lines = lines(&path);
    assert_eq!(lines.len(), 7);
    assert_eq!(lines[5]["key"], 4);
    assert_eq!(lines[6]["ended_by"], "max_records");
}
