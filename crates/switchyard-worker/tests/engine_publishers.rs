//! Conformance of the worker's KV event follower with the engines' OWN publisher code.
//!
//! `tests/python/engines/publisher.py` runs the real KV event modules of vLLM 0.23.0 (positional
//! events, 3-frame replay replies), vLLM 0.33.0 (map events, 4-frame replies) and SGLang 0.5.23
//! (its event recorder: signed hashes, merged, partial and bigram pages), two data-parallel
//! ranks each on free loopback ports, driven step by step over stdin. The worker's real
//! follower ([`follow_rank`], one per rank, into one [`RelayShared`]) listens in-process; after
//! each phase the test waits until every rank applied every batch its publisher sent, then
//! compares the worker's event log snapshot (block hashes and tiers) with Switchyard's chained
//! hashes of the token prefixes the script stored.
//!
//! The modules are fetched once with `python3 tests/python/engines/fetch.py` (into
//! `$SWITCHYARD_ENGINE_MODULES`, default `~/.cache/switchyard/engine-modules`); python3 needs
//! pyzmq, pydantic and msgspec.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_core::{BlockHash, BlockSize, KvIdentity, StorageTier, WorkerId, block_hashes};
use switchyard_worker::engine::kv_relay::KvRelay;
use switchyard_worker::engine::stats::{AdapterCounters, AdapterStats};
use switchyard_worker::engine::zmq_events::{
    RankEndpoints, RelayShared, follow_rank, rank_endpoint,
};
use switchyard_worker::event_log::{EventLog, SubscriptionStart};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::time::{Instant, sleep, timeout};
use tokio_util::sync::CancellationToken;

use StorageTier::{Device, Host, Remote};

/// The publishers' block (page) size, and the worker's.
const BS: u32 = 4;
const RANKS: u32 = 2;
const TOPIC: &str = "kv-events";
/// Generous: the machine running this may be busy.
const DEADLINE: Duration = Duration::from_secs(60);
const PROBE_WAIT: Duration = Duration::from_millis(300);
const PUBLISHER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/python/engines/publisher.py"
);

type View = BTreeSet<(BlockHash, StorageTier)>;

/// A release of fetch.py's matrix (named like the tests that run it).
#[derive(Debug, Clone, Copy)]
struct Release(&'static str, &'static str);

#[allow(non_upper_case_globals)]
mod releases {
    use super::Release;
    pub const vllm_0_23_0: Release = Release("vllm", "0.23.0");
    pub const vllm_0_33_0: Release = Release("vllm", "0.33.0");
    pub const sglang_0_5_23: Release = Release("sglang", "0.5.23");
}

impl Release {
    fn vllm(self) -> bool {
        self.0 == "vllm"
    }
}

/// Where fetch.py keeps the engines' modules.
fn modules_dir() -> PathBuf {
    match std::env::var_os("SWITCHYARD_ENGINE_MODULES") {
        Some(dir) if !dir.is_empty() => dir.into(),
        _ => PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
            .join(".cache/switchyard/engine-modules"),
    }
}

/// One publisher.py process: the release's real publishers, one per rank.
struct Publisher {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    ports: (u16, u16),
    /// Batches each rank has sent (live or dropped on purpose): its next sequence number.
    published: Vec<u64>,
    release: Release,
}

impl Publisher {
    async fn start(release: Release, env: &[(&str, &str)]) -> Publisher {
        let (dir, Release(package, version)) = (modules_dir(), release);
        assert!(
            dir.join(format!("{package}-{version}/{package}")).is_dir(),
            "the {package} {version} modules are not in {} (SWITCHYARD_ENGINE_MODULES, else the \
             default cache): run `python3 tests/python/engines/fetch.py` first",
            dir.display()
        );
        let args = format!(
            "{PUBLISHER} --engine {package} --version {version} --dp-ranks {RANKS} --topic {TOPIC} \
             --page-size {BS} --script -"
        );
        let mut child = Command::new("python3")
            .args(args.split(' '))
            .arg("--modules")
            .arg(&dir)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs tests/python/engines/publisher.py");
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let (ports, published) = ((0, 0), vec![0; RANKS as usize]);
        let mut p = Publisher {
            _child: child,
            stdin,
            lines,
            ports,
            published,
            release,
        };
        let ready = p.answer("READY").await;
        let port = |key: &str| ready[key][0].as_u64().unwrap() as u16;
        p.ports = (port("pub_ports"), port("replay_ports"));
        p
    }

    /// The next line, which must start with `word`; its JSON.
    async fn answer(&mut self, word: &str) -> Value {
        let line = timeout(DEADLINE, self.lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("publisher.py did not answer {word} in time"))
            .expect("publisher.py stdout")
            .unwrap_or_else(|| {
                panic!(
                    "publisher.py exited before {word} (its stderr is above; it needs python3 \
                     with pyzmq, pydantic and msgspec: `python3 -m pip install msgspec`)"
                )
            });
        let rest = line.strip_prefix(word);
        serde_json::from_str(rest.unwrap_or_else(|| panic!("not {word}: {line:?}"))).unwrap()
    }

    /// Runs one script step and waits for its answer.
    async fn step(&mut self, step: Value) {
        let line = format!("{step}\n");
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        self.stdin.flush().await.unwrap();
        let events = step.get("events").and_then(Value::as_array);
        if events.is_some_and(|e| !e.is_empty()) || step.get("probe").is_some() {
            let answer = self.answer("PUBLISHED").await;
            let rank = answer["rank"].as_u64().unwrap() as usize;
            let seq = answer["seq"].as_u64();
            assert_eq!(seq, Some(self.published[rank]), "{answer}");
            self.published[rank] += 1;
        } else {
            self.answer("OK").await;
        }
    }

    /// One batch of `events` from `rank`.
    async fn send(&mut self, rank: u32, events: Vec<Value>) {
        self.step(json!({"rank": rank, "events": events})).await;
    }

    /// A store of `tokens[from * BS..]`, continuing the prefix before it, which was stored as
    /// node `parent` (SGLang's recorder works on radix nodes, named here by `id`).
    fn store(&self, id: &str, parent: Option<&str>, tokens: &[u32], from: usize) -> Value {
        if self.release.vllm() {
            json!({"type": "StoreSeq", "tokens": tokens, "block_size": BS, "from_block": from})
        } else {
            let own = &tokens[from * BS as usize..];
            json!({"type": "StoreNode", "id": id, "parent": parent, "tokens": own})
        }
    }

    /// The eviction of stored blocks (vLLM: one event per block, last first; SGLang: a node).
    fn remove(&self, id: &str, tokens: &[u32], blocks: Range<usize>) -> Value {
        if self.release.vllm() {
            let blocks: Vec<usize> = blocks.rev().collect();
            json!({"type": "RemoveSeq", "tokens": tokens, "block_size": BS, "blocks": blocks})
        } else {
            json!({"type": "RemoveNode", "id": id})
        }
    }

    fn cleared(&self) -> Value {
        json!({"type": if self.release.vllm() { "AllBlocksCleared" } else { "ClearAll" }})
    }
}

/// `event` with more fields.
fn with(mut event: Value, extra: Value) -> Value {
    if let (Value::Object(event), Value::Object(extra)) = (&mut event, extra) {
        event.extend(extra);
    }
    event
}

/// The worker side: the real followers of every rank, into one relay and log.
struct Worker {
    shared: Arc<RelayShared>,
    cancel: CancellationToken,
    /// Events the scenario expects the worker to skip (on rank 0), e.g. SGLang's bigram pages.
    expect_skipped: std::sync::atomic::AtomicU64,
}

impl Worker {
    fn follow(publisher: &Publisher) -> Worker {
        let bs = BlockSize::new(BS).unwrap();
        let shared = Arc::new(RelayShared {
            relay: Mutex::new(KvRelay::new(bs, RANKS, 100_000)),
            log: Arc::new(EventLog::new(WorkerId::new("w").unwrap(), 1, 10_000)),
            counters: Arc::new(AdapterCounters::new(RANKS)),
        });
        let cancel = CancellationToken::new();
        for rank in 0..RANKS {
            // The worker's own port offsetting, against the engines'.
            let at = |port: u16| rank_endpoint(&format!("tcp://127.0.0.1:{port}"), rank).unwrap();
            let (events, replay) = (at(publisher.ports.0), Some(at(publisher.ports.1)));
            let endpoints = RankEndpoints {
                rank,
                events,
                replay,
            };
            let follow = follow_rank(endpoints, TOPIC.into(), Arc::clone(&shared), cancel.clone());
            tokio::spawn(follow);
        }
        Worker {
            shared,
            cancel,
            expect_skipped: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Follows `publisher` and makes sure every rank's subscription receives. A PUB socket
    /// drops what it sends before a subscriber is connected, so this sends empty probe batches
    /// until each rank applied all its batches (a lost one is replayed with a later one).
    async fn start(publisher: &mut Publisher) -> Worker {
        let worker = Worker::follow(publisher);
        sleep(Duration::from_millis(200)).await; // fewer lost probes; not needed
        for attempt in 0..200 {
            for rank in 0..RANKS {
                if attempt == 0 || worker.stats(rank).batches < publisher.published[rank as usize] {
                    publisher.step(json!({"rank": rank, "probe": true})).await;
                }
            }
            if worker.caught_up(publisher, PROBE_WAIT).await {
                return worker;
            }
        }
        panic!(
            "ranks never received: published {:?}, {:#?}",
            publisher.published,
            worker.stats_all()
        );
    }

    fn stats(&self, rank: u32) -> AdapterStats {
        self.shared.counters.rank(rank).snapshot()
    }

    fn stats_all(&self) -> Vec<AdapterStats> {
        self.shared.counters.per_rank()
    }

    /// The blocks of the worker's event log.
    fn view(&self) -> View {
        match self.shared.log.subscribe(None, 0).start {
            SubscriptionStart::Snapshot { blocks, .. } => {
                blocks.iter().map(|b| (b.hash, b.tier)).collect()
            }
            SubscriptionStart::Replay(_) => unreachable!("no resume point was given"),
        }
    }

    /// Whether every rank applied every batch its publisher sent, within `wait`. (The
    /// followers run on this test's one thread and apply a batch without yielding, so a
    /// counted batch is in the log.)
    async fn caught_up(&self, publisher: &Publisher, wait: Duration) -> bool {
        let until = Instant::now() + wait;
        loop {
            let done = (0..RANKS).all(|r| self.stats(r).batches >= publisher.published[r as usize]);
            if done || Instant::now() > until {
                return done;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the worker applied everything published, then checks its view is `want`.
    async fn assert_view(&self, publisher: &Publisher, want: &View, phase: &str) -> View {
        let caught_up = self.caught_up(publisher, DEADLINE).await;
        let stats = self.stats_all();
        let applied: Vec<u64> = stats.iter().map(|s| s.batches).collect();
        assert!(
            caught_up && applied == publisher.published,
            "{phase}: published {:?}, {stats:#?}",
            publisher.published
        );
        let skipped = self
            .expect_skipped
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            stats.iter().all(|s| s.malformed == 0)
                && stats.iter().map(|s| s.skipped_events).sum::<u64>() == skipped,
            "{phase}: expected {skipped} skipped events, {stats:#?}"
        );
        let view = self.view();
        let held = self.shared.relay.lock().unwrap().held_blocks();
        let held: View = held.into_iter().collect();
        assert_eq!(
            held, view,
            "{phase}: the relay's holds and the log disagree"
        );
        assert!(
            &view == want,
            "{phase}: worker view != engine\n  missing: {:?}\n  extra: {:?}\n  {stats:#?}",
            want.difference(&view).collect::<Vec<_>>(),
            view.difference(want).collect::<Vec<_>>(),
        );
        view
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn seq(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// Switchyard's names of the full blocks of `tokens` from block `from` on, in `tier`.
fn blocks_from(tokens: &[u32], from: usize, tier: StorageTier) -> View {
    let hashes = block_hashes(tokens, BlockSize::new(BS).unwrap());
    hashes[from..].iter().map(|h| (*h, tier)).collect()
}

/// All full blocks of `tokens` on the device.
fn dev(tokens: &[u32]) -> View {
    blocks_from(tokens, 0, Device)
}

fn union(parts: impl IntoIterator<Item = View>) -> View {
    parts.into_iter().flatten().collect()
}

fn minus(view: &View, gone: &View) -> View {
    view.difference(gone).copied().collect()
}

/// Stores (a prefix shared across ranks, host and external copies, blocks keyed by an adapter
/// or a salt), evictions and cache clears.
async fn stores(release: Release, env: &[(&str, &str)]) {
    let mut p = Publisher::start(release, env).await;
    let w = Worker::start(&mut p).await;
    let (t1, other) = (seq(1, 12), seq(200, 8));
    let t2 = [&t1[..4], &seq(100, 4)[..]].concat();
    // Rank 0 holds t1 and copies to host memory (vLLM's offloading: t1's first two blocks;
    // SGLang: a node continuing t1's second page); SGLang also has a node in its external pool.
    let (host_tokens, host_from) = if release.vllm() {
        (t1[..8].to_vec(), 0)
    } else {
        ([&t1[..8], &seq(40, 4)[..]].concat(), 2)
    };
    let host_medium = json!({"medium": if release.vllm() { "CPU" } else { "CPU_PINNED" }});
    let (a, b) = (
        p.store("a", None, &t1[..8], 0),
        p.store("b", Some("a"), &t1, 2),
    );
    let mut rank0 = vec![a, b];
    if release.vllm() {
        let copy = p.store("-", None, &host_tokens, 0);
        rank0.push(with(copy, host_medium.clone()));
    } else {
        let (copy, pool) = (
            p.store("h", Some("a"), &host_tokens, 2),
            p.store("x", None, &other, 0),
        );
        rank0.push(with(copy, host_medium.clone()));
        rank0.push(with(pool, json!({"medium": "EXTERNAL"})));
    }
    p.send(0, rank0).await;
    // Rank 1 shares t1's first block, then goes its own way.
    p.send(
        1,
        vec![
            p.store("r1", None, &t2[..4], 0),
            p.store("r2", Some("r1"), &t2, 1),
        ],
    )
    .await;
    let external = if release.vllm() {
        View::new()
    } else {
        blocks_from(&other, 0, Remote)
    };
    let host = blocks_from(&host_tokens, host_from, Host);
    let plain = union([dev(&t1), host.clone(), dev(&t2), external]);
    w.assert_view(&p, &plain, "stores").await;

    // The same tokens under an adapter or a cache salt are other blocks, and exactly the ones a
    // request naming that adapter and salt hashes to (`KvIdentity`): vLLM publishes the
    // adapter's name and the salt untagged in each block's extra keys (the salt on the prompt's
    // first block only) and `lora_name`; SGLang names both once per event.
    let (lora, salt) = (
        KvIdentity::new(Some("lora-a".into()), None).unwrap(),
        KvIdentity::new(None, Some("tenant-1".into())).unwrap(),
    );
    let keyed = if release.vllm() {
        let lora_keys =
            json!({"lora_id": 7, "lora_name": "lora-a", "extra_keys": [["lora-a"], ["lora-a"]]});
        let salt_keys = json!({"extra_keys": [["tenant-1"]]});
        vec![
            with(p.store("-", None, &t1[..8], 0), lora_keys),
            with(p.store("-", None, &t1[..4], 0), salt_keys),
        ]
    } else {
        let lora_keys =
            json!({"extra_key": "k-0123456789abcdef0123456789abcdef", "lora_name": "lora-a"});
        let salt_keys = json!({"cache_salt": "tenant-1"});
        vec![
            with(p.store("l", None, &t1[..8], 0), lora_keys),
            with(p.store("s", None, &t1[..4], 0), salt_keys),
        ]
    };
    p.send(0, keyed).await;
    assert!(w.caught_up(&p, DEADLINE).await, "{:#?}", w.stats_all());
    let with_keyed = w.view();
    let extra = minus(&with_keyed, &plain);
    let bs = BlockSize::new(BS).unwrap();
    let requested: View = [
        lora.block_hashes(&t1[..8], bs),
        salt.block_hashes(&t1[..4], bs),
    ]
    .into_iter()
    .flatten()
    .map(|h| (h, Device))
    .collect();
    assert!(with_keyed.is_superset(&plain), "{extra:?}");
    assert_eq!(
        extra, requested,
        "keyed blocks are named as a request with that adapter or salt names them"
    );
    let plain_hashes: BTreeSet<BlockHash> = plain.iter().map(|(h, _)| *h).collect();
    assert!(
        extra.iter().all(|(h, _)| !plain_hashes.contains(h)),
        "a keyed block took a plain block's name: {extra:?}"
    );

    // Rank 0 evicts t1's last block, its first (rank 1 still holds it: it stays) and its host
    // copies (vLLM evicts block by block; SGLang node by node, so t1's second block goes too).
    let (removals, gone) = if release.vllm() {
        let removals = vec![
            p.remove("-", &t1, 2..3),
            p.remove("-", &t1, 0..1),
            with(p.remove("-", &host_tokens, 0..2), host_medium),
        ];
        (removals, union([blocks_from(&t1, 2, Device), host]))
    } else {
        let removals = vec![
            p.remove("b", &t1, 2..3),
            with(p.remove("h", &host_tokens, 2..3), host_medium),
            p.remove("a", &t1, 0..2),
        ];
        (removals, union([blocks_from(&t1, 1, Device), host]))
    };
    p.send(0, removals).await;
    let want = w
        .assert_view(&p, &minus(&with_keyed, &gone), "evictions")
        .await;

    // Rank 1 clears its cache: t2's blocks go, t1's first with them (rank 0 evicted it).
    let c = p.cleared();
    p.send(1, vec![c]).await;
    w.assert_view(&p, &minus(&want, &dev(&t2)), "rank 1 cleared")
        .await;
    let c = p.cleared();
    p.send(0, vec![c]).await;
    w.assert_view(&p, &View::new(), "rank 0 cleared").await;
}

/// A batch lost on the live stream of each rank is repaired through the replay socket.
async fn gap_repaired_by_replay(release: Release) {
    let mut p = Publisher::start(release, &[]).await;
    let w = Worker::start(&mut p).await;
    let (a, b) = (seq(1, 8), seq(1, 12));
    p.send(0, vec![p.store("a", None, &a, 0)]).await;
    p.send(1, vec![p.store("c", None, &seq(300, 8), 0)]).await;
    w.assert_view(&p, &union([dev(&a), dev(&seq(300, 8))]), "before the gaps")
        .await;
    let before = w.stats_all();
    for rank in 0..RANKS {
        p.step(json!({"rank": rank, "drop_live": 1})).await;
    }
    // Lost live (b continues a: only the replay can relate it); the next batches show the gaps.
    p.send(0, vec![p.store("b", Some("a"), &b, 2)]).await;
    p.send(1, vec![p.store("e", None, &seq(600, 4), 0)]).await;
    p.send(0, vec![p.store("d", None, &seq(500, 8), 0)]).await;
    p.send(1, vec![p.store("f", None, &seq(700, 4), 0)]).await;
    let want = union([
        dev(&b),
        dev(&seq(300, 8)),
        dev(&seq(500, 8)),
        dev(&seq(600, 4)),
        dev(&seq(700, 4)),
    ]);
    w.assert_view(&p, &want, "after the gaps").await;
    let counts = |s: &AdapterStats| [s.gaps, s.replays, s.replayed_batches, s.resyncs];
    for (rank, (now, then)) in w.stats_all().iter().zip(&before).enumerate() {
        let delta: Vec<u64> = counts(now)
            .iter()
            .zip(counts(then))
            .map(|(n, t)| n - t)
            .collect();
        // One gap, one replay of the one lost batch, no resync.
        assert_eq!(delta, [1, 1, 1, 0], "rank {rank}: {now:#?}");
    }
}

/// A worker that starts after the engine published learns the earlier blocks from the replay.
async fn late_join_recovers_through_replay(release: Release) {
    let mut p = Publisher::start(release, &[]).await;
    let (a, b) = (seq(1, 8), seq(1, 12));
    p.send(0, vec![p.store("a", None, &a, 0)]).await;
    p.send(0, vec![p.store("b", Some("a"), &b, 2)]).await;
    p.send(1, vec![p.store("c", None, &seq(300, 8), 0)]).await;
    let w = Worker::start(&mut p).await;
    w.assert_view(&p, &union([dev(&b), dev(&seq(300, 8))]), "joined")
        .await;
    for (rank, s) in w.stats_all().iter().enumerate() {
        let earlier = [2, 1][rank];
        assert!(
            s.replays >= 1 && s.replayed_batches >= earlier,
            "rank {rank}: {s:#?}"
        );
        assert_eq!(
            (s.gaps, s.resyncs, s.unrelatable),
            (0, 0, 0),
            "rank {rank}: {s:#?}"
        );
    }
}

/// A cached prefix announced again (vLLM 0.33's `kv_cache_report_mode = "full"`: the whole
/// prefix, parent nil) and then evicted once, block by block, leaves nothing behind.
async fn re_announced_stores_leave_nothing(release: Release) {
    let mut p = Publisher::start(release, &[]).await;
    let w = Worker::start(&mut p).await;
    let t = seq(1, 12);
    for id in ["a", "again", "and-again"] {
        p.send(0, vec![p.store(id, None, &t, 0)]).await;
    }
    w.assert_view(&p, &dev(&t), "announced three times").await;
    assert_eq!(w.stats(0).duplicate_stores, 6, "{:#?}", w.stats(0));
    p.send(0, vec![p.remove("a", &t, 0..3)]).await;
    w.assert_view(&p, &View::new(), "evicted once").await;
    assert_eq!(w.stats(0).unknown_removals, 0, "{:#?}", w.stats(0));
}

/// vLLM publishes per KV-cache group, the same hash in several groups: a block stays until
/// every group evicted it.
async fn kv_cache_groups_are_tracked_apart(release: Release) {
    let mut p = Publisher::start(release, &[]).await;
    let w = Worker::start(&mut p).await;
    let t = seq(1, 8);
    let group = |g: u32| json!({"group_idx": g});
    let stores = vec![
        with(p.store("-", None, &t, 0), group(0)),
        with(p.store("-", None, &t, 0), group(1)),
    ];
    p.send(0, stores).await;
    w.assert_view(&p, &dev(&t), "stored in both groups").await;
    p.send(0, vec![with(p.remove("-", &t, 0..2), group(0))])
        .await;
    w.assert_view(&p, &dev(&t), "group 1 still holds them")
        .await;
    p.send(0, vec![with(p.remove("-", &t, 0..2), group(1))])
        .await;
    w.assert_view(&p, &View::new(), "both groups evicted").await;
    assert_eq!(w.stats(0).unknown_removals, 0, "{:#?}", w.stats(0));
}

/// SGLang's recorder, one batch: a node whose full pages merge into its parent's event and
/// whose partial last page is an event of its own, and an EAGLE bigram page.
async fn partial_and_bigram_pages(release: Release) {
    let mut p = Publisher::start(release, &[]).await;
    let w = Worker::start(&mut p).await;
    let t = seq(1, 14); // 3 full pages and 2 tokens
    let bigram = seq(30, 5); // pairs (30,31) .. (33,34): one page of 4
    let g = json!({"type": "StoreNode", "id": "g", "tokens": bigram, "bigram": true});
    p.send(
        0,
        vec![
            p.store("a", None, &t[..8], 0),
            p.store("b", Some("a"), &t, 2),
            g,
        ],
    )
    .await;
    // A bigram page is skipped (its engine hash covers the token after each pair, which a
    // prefix of plain tokens cannot name), counted, and the store beside it is kept.
    w.expect_skipped
        .store(1, std::sync::atomic::Ordering::Relaxed);
    w.assert_view(&p, &dev(&t), "partial and bigram pages")
        .await;
    assert_eq!(w.stats(0).partial_blocks, 1, "{:#?}", w.stats(0));
    p.send(0, vec![p.remove("b", &t, 2..4)]).await;
    w.assert_view(&p, &dev(&t[..8]), "node b evicted").await;
}

/// A `BlockStored` of larger blocks than the worker's is skipped and counted, not indexed; the
/// store beside it in the batch is kept.
async fn larger_block_size_is_skipped(release: Release) {
    let mut p = Publisher::start(release, &[]).await;
    let w = Worker::start(&mut p).await;
    let t = seq(1, 8);
    let mut big = json!({"type": "BlockStored", "block_hashes": [777], "parent_block_hash": null,
        "token_ids": seq(100, 8), "block_size": 2 * BS, "lora_id": null, "medium": "GPU"});
    if release.vllm() {
        big = with(big, json!({"group_idx": 0}));
    }
    p.send(0, vec![p.store("a", None, &t, 0), big]).await;
    w.assert_view(&p, &dev(&t), "larger blocks").await;
    assert_eq!(w.stats(0).block_size_mismatches, 1, "{:#?}", w.stats(0));
}

async fn stores_removals_and_clears(release: Release) {
    stores(release, &[]).await;
}

/// The same with vLLM's 32-byte hashes instead of u64s.
async fn stores_with_byte_hashes(release: Release) {
    stores(release, &[("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")]).await;
}

/// One test per release for each scenario: `<scenario>::<release>`.
macro_rules! matrix {
    ($scenario:ident: $($release:ident),+) => {
        mod $scenario {
            $(
                #[tokio::test]
                async fn $release() {
                    super::$scenario(super::releases::$release).await;
                }
            )+
        }
    };
}

matrix!(stores_removals_and_clears: vllm_0_23_0, vllm_0_33_0, sglang_0_5_23);
matrix!(stores_with_byte_hashes: vllm_0_23_0, vllm_0_33_0);
matrix!(gap_repaired_by_replay: vllm_0_23_0, vllm_0_33_0, sglang_0_5_23);
matrix!(late_join_recovers_through_replay: vllm_0_23_0, vllm_0_33_0, sglang_0_5_23);
matrix!(re_announced_stores_leave_nothing: vllm_0_23_0, vllm_0_33_0, sglang_0_5_23);
matrix!(kv_cache_groups_are_tracked_apart: vllm_0_23_0, vllm_0_33_0);
matrix!(partial_and_bigram_pages: sglang_0_5_23);
matrix!(larger_block_size_is_skipped: vllm_0_23_0, vllm_0_33_0, sglang_0_5_23);
