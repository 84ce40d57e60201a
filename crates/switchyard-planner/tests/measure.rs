//! `switchyard planner profile`'s measurement against a real worker (in-process agent over
//! loopback gRPC, simulated engine in real time): the profile it writes is valid and orders
//! its figures the way the timing model does. Only ratios within this one run are compared.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use switchyard_core::{BlockSize, Role};
use switchyard_planner::PerformanceProfile;
use switchyard_planner::measure::{MeasureSettings, measure};
use switchyard_worker::WorkerConfig;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_measured_profile_is_valid_and_ordered_like_the_timing_model() {
    let mut config = WorkerConfig {
        id: Some("profiled".into()),
        role: Role::Both,
        ..WorkerConfig::default()
    };
    config.sim.block_size = BlockSize::new(16).unwrap();
    config.sim.num_device_blocks = 2048;
    config.sim.max_context_tokens = 4096;
    let shutdown = CancellationToken::new();
    let (ready_tx, ready_rx) = oneshot::channel();
    let task = tokio::spawn(switchyard_worker::run(
        config,
        None,
        shutdown.clone(),
        move |running| {
            let _ = ready_tx.send(running.local_addr);
        },
    ));
    let addr = ready_rx.await.unwrap();
    let settings = MeasureSettings {
        // 8192 exceeds the worker's context: skipped, not fatal.
        prefill_lengths: vec![256, 2048, 8192],
        decode_contexts: vec![512, 2048],
        decode_concurrency: vec![1, 32],
        decode_tokens: 16,
        repeats: 1,
        ..MeasureSettings::default()
    };
    let mut lines = Vec::new();
    let profile = measure(&addr.to_string(), &settings, |l| lines.push(l.to_owned()))
        .await
        .unwrap();
    profile.validate().unwrap();
    assert_eq!(profile.prefill.len(), 2, "{lines:?}");
    assert!(
        lines.iter().any(|l| l.contains("8192 tokens: skipped")),
        "{lines:?}"
    );
    assert_eq!(profile.decode.len(), 4);
    // The timing model: 2048 tokens take ~5.6x as long as 256; 32 sequences of 2048 tokens
    // decode ~1.7x slower than one of 512. Generous margins for a shared machine.
    let short = profile.prefill_seconds(256.0);
    let long = profile.prefill_seconds(2048.0);
    assert!(long > 2.0 * short, "prefill 256: {short}, 2048: {long}");
    let light = profile.itl_seconds(1.0, 512.0);
    let heavy = profile.itl_seconds(32.0, 2048.0);
    assert!(heavy > 1.2 * light, "ITL 1x512: {light}, 32x2048: {heavy}");
    // The file round-trips through the loader the planner uses.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("profile.json");
    std::fs::write(&path, serde_json::to_string(&profile).unwrap()).unwrap();
    // serde_json may read a float back one unit in the last place off: compare closely.
    let loaded = PerformanceProfile::load(&path).unwrap();
    assert_eq!(loaded.prefill.len(), profile.prefill.len());
    assert_eq!(loaded.decode.len(), profile.decode.len());
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
    for (a, b) in loaded.prefill.iter().zip(&profile.prefill) {
        assert!(a.input_tokens == b.input_tokens && close(a.seconds, b.seconds));
    }
    for (a, b) in loaded.decode.iter().zip(&profile.decode) {
        assert!(a.concurrency == b.concurrency && close(a.itl_seconds, b.itl_seconds));
    }
    assert!(
        measure("not an address", &settings, |_| {}).await.is_err(),
        "a bad address is an error, not a panic"
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}
