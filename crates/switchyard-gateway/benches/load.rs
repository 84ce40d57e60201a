//! End-to-end load test: the gateway, an in-memory registry and simulated workers in one
//! process, driven over loopback by keep-alive HTTP/1.1 clients; and a time-to-first-token
//! comparison, gateway vs the worker's gRPC `Generate` directly.
//!
//! The workers run with a huge speedup, so a generation takes no simulated time and what is
//! measured is the gateway (HTTP, JSON, tokenizer, routing, gRPC, bookkeeping). The gateway, the
//! workers and the client each get their own runtime with named threads, so the CPU each used
//! is read from `/proc/self/task/*/stat` and reported: on a small machine they share the cores.
//!
//! `cargo bench -p switchyard-gateway --bench load -- [--requests N] [--connections K]
//!  [--workers W] [--gateway-threads T] [--chat] [--url http://host:port] [--ttft N]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_gateway::GatewayConfig;
use switchyard_proto::v1::worker_client::WorkerClient;
use switchyard_proto::v1::{GenerateRequest, SamplingParams};
use switchyard_registry::{MemoryRegistry, Registry};
use switchyard_tokenize::ModelDir;
use switchyard_worker::WorkerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const PROMPT: &str = "Write one sentence about the sea.";

struct Args {
    requests: usize,
    connections: usize,
    workers: usize,
    gateway_threads: usize,
    chat: bool,
    url: Option<String>,
    ttft: usize,
}

fn args() -> Args {
    let mut a = Args {
        requests: 40_000,
        connections: 64,
        workers: 4,
        gateway_threads: 2,
        chat: false,
        url: None,
        ttft: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().expect("flag value");
        match flag.as_str() {
            "--requests" => a.requests = value().parse().unwrap(),
            "--connections" => a.connections = value().parse().unwrap(),
            "--workers" => a.workers = value().parse().unwrap(),
            "--gateway-threads" => a.gateway_threads = value().parse().unwrap(),
            "--chat" => a.chat = true,
            "--url" => a.url = Some(value()),
            "--ttft" => a.ttft = value().parse().unwrap(),
            _ => {} // cargo bench passes `--bench`
        }
    }
    a
}

/// Per-thread-name CPU seconds of this process (user + system), threads grouped by the name
/// prefix before the first `-`.
fn cpu_by_thread() -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for entry in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close]
            .split('-')
            .next()
            .unwrap_or("")
            .to_owned();
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        // utime and stime are fields 14 and 15 of stat; the slice starts at field 3.
        let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
        *out.entry(name).or_insert(0.0) += ticks / 100.0;
    }
    out
}

fn body(chat: bool, i: usize, stream: bool) -> String {
    let max_tokens = 1 + i % 4;
    if chat {
        format!(
            r#"{{"model":"sim-8b","messages":[{{"role":"user","content":"{PROMPT}"}}],"max_tokens":{max_tokens},"stream":{stream}}}"#
        )
    } else {
        format!(
            r#"{{"model":"sim-8b","prompt":"{PROMPT}","max_tokens":{max_tokens},"stream":{stream}}}"#
        )
    }
}

fn request(chat: bool, i: usize, stream: bool, close: bool) -> Vec<u8> {
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let body = body(chat, i, stream);
    let connection = if close { "close" } else { "keep-alive" };
    format!(
        "POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\nconnection: {connection}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Reads one HTTP/1.1 response with a `content-length` body; returns its status.
async fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>) -> u16 {
    buf.clear();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = find(buf, b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..end])
                .unwrap()
                .to_ascii_lowercase();
            let status: u16 = head[9..12].parse().unwrap();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().unwrap())
                .expect("content-length");
            while buf.len() < end + 4 + length {
                let n = stream.read(&mut chunk).await.unwrap();
                assert!(n > 0, "connection closed mid-body");
                buf.extend_from_slice(&chunk[..n]);
            }
            return status;
        }
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed");
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Drives `requests` requests over `connections` keep-alive connections; returns the wall time,
/// every latency and the non-200 count.
async fn drive(
    addr: SocketAddr,
    chat: bool,
    requests: usize,
    connections: usize,
) -> (Duration, Vec<Duration>, usize) {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..connections {
        let share = requests / connections + usize::from(c < requests % connections);
        tasks.push(tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let mut buf = Vec::with_capacity(4096);
            let mut latencies = Vec::with_capacity(share);
            let mut errors = 0;
            for i in 0..share {
                let req = request(chat, c + i, false, false);
                let t = Instant::now();
                stream.write_all(&req).await.unwrap();
                let status = read_response(&mut stream, &mut buf).await;
                latencies.push(t.elapsed());
                if status != 200 {
                    errors += 1;
                    if errors == 1 {
                        eprintln!("status {status}: {}", String::from_utf8_lossy(&buf));
                    }
                }
            }
            (latencies, errors)
        }));
    }
    let mut all = Vec::with_capacity(requests);
    let mut errors = 0;
    for task in tasks {
        let (latencies, e) = task.await.unwrap();
        all.extend(latencies);
        errors += e;
    }
    let wall = started.elapsed();
    all.sort_unstable();
    (wall, all, errors)
}

/// Time from sending a streaming request (on a kept-alive connection) to reading its first
/// server-sent event; the rest of the stream is read to its end.
async fn gateway_ttft(stream: &mut TcpStream, chat: bool, i: usize) -> Duration {
    let req = request(chat, i, true, false);
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 8192];
    let t = Instant::now();
    stream.write_all(&req).await.unwrap();
    let mut ttft = None;
    loop {
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed mid-stream");
        buf.extend_from_slice(&chunk[..n]);
        if ttft.is_none()
            && let Some(end) = find(&buf, b"\r\n\r\n")
            && find(&buf[end..], b"data: ").is_some()
        {
            ttft = Some(t.elapsed());
        }
        // The chunked body ends with a zero-length chunk after `data: [DONE]`.
        if find(&buf, b"[DONE]").is_some() && buf.ends_with(b"0\r\n\r\n") {
            return ttft.unwrap();
        }
    }
}

async fn worker_ttft(
    client: &mut WorkerClient<tonic::transport::Channel>,
    prompt: &[u32],
    i: usize,
) -> Duration {
    let request = GenerateRequest {
        priority: None,
        request_id: format!("direct-{i}"),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(SamplingParams {
            max_tokens: 1 + (i % 4) as u32,
            temperature: Some(0.0),
            seed: None,
            ignore_eos: true,
            stop_token_ids: Vec::new(),
            ..Default::default()
        }),
        kv_source: None,
        identity: None,
        retention: None,
    };
    let t = Instant::now();
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let first = stream.message().await.unwrap();
    let ttft = t.elapsed();
    assert!(first.is_some());
    while stream.message().await.unwrap().is_some() {}
    ttft
}

fn runtime(name: &str, threads: usize) -> tokio::runtime::Runtime {
    let mut b = if threads == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    b.thread_name(name).enable_all().build().unwrap()
}

fn main() {
    let args = args();
    let sims = runtime("sim-rt", 1);
    let gateway = runtime("gw-rt", args.gateway_threads);
    let client = runtime("client", 0);
    let stop = CancellationToken::new();

    let mut worker_addrs = Vec::new();
    let addr: SocketAddr = match &args.url {
        Some(url) => url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .parse()
            .unwrap(),
        None => {
            let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
            for i in 0..args.workers {
                let config = WorkerConfig {
                    id: Some(format!("sim-{i}")),
                    speedup: 1e9,
                    ..WorkerConfig::default()
                };
                let (tx, rx) = std::sync::mpsc::channel();
                let registry = Arc::clone(&registry);
                let stop = stop.clone();
                sims.spawn(async move {
                    switchyard_worker::run(config, Some(registry), stop, move |w| {
                        tx.send(w.info.address.clone()).unwrap();
                    })
                    .await
                    .unwrap();
                });
                worker_addrs.push(rx.recv().unwrap());
            }
            let config = GatewayConfig {
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                ..GatewayConfig::default()
            };
            let (tx, rx) = std::sync::mpsc::channel();
            let stop = stop.clone();
            gateway.spawn(async move {
                switchyard_gateway::run(config, registry, stop, move |a| tx.send(a).unwrap())
                    .await
                    .unwrap();
            });
            rx.recv().unwrap()
        }
    };
    println!(
        "gateway at {addr}; {} simulated workers (speedup 1e9); gateway runtime {} threads; {} cores",
        args.workers,
        args.gateway_threads,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // The client runs on its own named thread so its CPU is counted apart.
    let ttft_workers = args.workers;
    let client_thread = std::thread::Builder::new().name("client".into()).spawn(move || client.block_on(async {
        // Wait until every worker is routable, then warm up.
        for _ in 0..200 {
            let (_, _, errors) = drive(addr, args.chat, 8, 1).await;
            if errors == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        drive(addr, args.chat, 2_000, args.connections).await;

        if args.requests > 0 {
            let cpu_before = cpu_by_thread();
            let (wall, latencies, errors) =
                drive(addr, args.chat, args.requests, args.connections).await;
            let cpu_after = cpu_by_thread();
            let endpoint = if args.chat {
                "chat/completions"
            } else {
                "completions"
            };
            println!(
                "{} non-streaming /v1/{endpoint} requests (max_tokens 1..4) over {} keep-alive connections: {:.0} req/s, {} errors",
                args.requests,
                args.connections,
                args.requests as f64 / wall.as_secs_f64(),
                errors
            );
            println!(
                "latency ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.2}; {} over 20 ms",
                ms(percentile(&latencies, 0.5)),
                ms(percentile(&latencies, 0.9)),
                ms(percentile(&latencies, 0.99)),
                ms(*latencies.last().unwrap()),
                latencies.iter().filter(|d| d.as_millis() >= 20).count()
            );
            let secs = wall.as_secs_f64();
            let mut line = format!("CPU over {secs:.1} s wall (cores busy):");
            for (name, after) in &cpu_after {
                let used = after - cpu_before.get(name).copied().unwrap_or(0.0);
                if used > 0.005 {
                    line.push_str(&format!(" {name} {:.2}", used / secs));
                }
            }
            println!("{line}");
        }

        if args.ttft > 0 {
            let Some(worker) = worker_addrs.first() else {
                println!("--ttft needs the in-process setup");
                return;
            };
            assert_eq!(ttft_workers, 1, "--ttft compares against the only worker");
            let prompt = ModelDir::builtin().tokenizer().encode(PROMPT).unwrap();
            let mut direct = WorkerClient::connect(format!("http://{worker}"))
                .await
                .unwrap();
            let (mut via_gateway, mut via_grpc) = (Vec::new(), Vec::new());
            let mut http = TcpStream::connect(addr).await.unwrap();
            http.set_nodelay(true).unwrap();
            for i in 0..args.ttft + 100 {
                let g = gateway_ttft(&mut http, args.chat, i).await;
                let d = worker_ttft(&mut direct, &prompt, i).await;
                if i >= 100 {
                    via_gateway.push(g);
                    via_grpc.push(d);
                }
            }
            via_gateway.sort_unstable();
            via_grpc.sort_unstable();
            println!("TTFT over {} sequential streaming requests (same prompt, same worker), ms:", args.ttft);
            for (name, v) in [("via gateway (HTTP/1.1 keep-alive, SSE)", &via_gateway), ("worker gRPC Generate directly", &via_grpc)] {
                println!(
                    "  {name}: p50 {:.3}  p90 {:.3}  p99 {:.3}  max {:.3}; {} of {} over 20 ms",
                    ms(percentile(v, 0.5)),
                    ms(percentile(v, 0.9)),
                    ms(percentile(v, 0.99)),
                    ms(*v.last().unwrap()),
                    v.iter().filter(|d| d.as_millis() >= 20).count(),
                    v.len()
                );
            }
            println!(
                "  gateway adds: p50 {:.3} ms, p99 {:.3} ms",
                ms(percentile(&via_gateway, 0.5)) - ms(percentile(&via_grpc, 0.5)),
                ms(percentile(&via_gateway, 0.99)) - ms(percentile(&via_grpc, 0.99))
            );
        }
    })).unwrap();
    client_thread.join().unwrap();
    stop.cancel();
    gateway.shutdown_timeout(Duration::from_secs(2));
    sims.shutdown_timeout(Duration::from_secs(2));
}
