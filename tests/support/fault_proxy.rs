//! A fault-injecting TCP proxy for the chaos tests: it stands between the gateway and one
//! worker (the worker advertises the proxy's address) and does to every connection through it
//! what the test says, live:
//!
//! - [`Fault::Pass`] forwards bytes as they come;
//! - [`Fault::Delay`] holds every chunk, in both directions, that long before forwarding it;
//! - [`Fault::CutAfter`] closes each connection once it has forwarded that many more bytes
//!   (both directions together, counted from when the fault was set), as a broken link would;
//! - [`Fault::Blackhole`] forwards nothing: connections are accepted and what arrives is held,
//!   as a partitioned network or a dropped route would; lifting it lets the held bytes through;
//! - [`Fault::Refuse`] closes every live connection and stops listening, so new connections
//!   are refused (ECONNREFUSED) until another fault is set.
//!
//! The proxy and its connections are tasks owned by the [`FaultProxy`]: dropping it ends them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// What the proxy does to its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Pass,
    Delay(Duration),
    CutAfter(u64),
    Blackhole,
    Refuse,
}

/// The fault in force and when it was set (a new epoch restarts [`Fault::CutAfter`]'s count).
#[derive(Debug, Clone, Copy)]
struct Setting {
    epoch: u64,
    fault: Fault,
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    cut: AtomicU64,
}

/// One proxy, listening on a loopback port of its own and forwarding to `upstream`.
#[derive(Debug)]
pub struct FaultProxy {
    address: SocketAddr,
    setting_tx: watch::Sender<Setting>,
    counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // The accept task owns the connection tasks (a JoinSet): aborting it ends them all.
        self.task.abort();
    }
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream` (which need not be up yet:
    /// a connection that cannot reach it is closed).
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let address = listener.local_addr().expect("proxy address");
        let (setting_tx, setting_rx) = watch::channel(Setting {
            epoch: 0,
            fault: Fault::Pass,
        });
        let counters = Arc::new(Counters::default());
        let task = tokio::spawn(serve(
            listener,
            address,
            upstream,
            setting_rx,
            Arc::clone(&counters),
        ));
        FaultProxy {
            address,
            setting_tx,
            counters,
            task,
        }
    }

    /// The address clients dial (what the worker advertises).
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Applies `fault` from now on, to live connections and new ones alike.
    pub fn set(&self, fault: Fault) {
        self.setting_tx.send_modify(|setting| {
            setting.epoch += 1;
            setting.fault = fault;
        });
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.counters.accepted.load(Ordering::Relaxed)
    }

    /// Connections the proxy closed because of a fault ([`Fault::CutAfter`], [`Fault::Refuse`]).
    pub fn cut(&self) -> u64 {
        self.counters.cut.load(Ordering::Relaxed)
    }
}

async fn serve(
    listener: TcpListener,
    address: SocketAddr,
    upstream: SocketAddr,
    mut setting_rx: watch::Receiver<Setting>,
    counters: Arc<Counters>,
) {
    let mut listener = Some(listener);
    let mut connections = JoinSet::new();
    loop {
        // Reap finished connections so the set does not grow with the test.
        while connections.try_join_next().is_some() {}
        let refusing = setting_rx.borrow_and_update().fault == Fault::Refuse;
        if refusing {
            listener = None;
        } else if listener.is_none() {
            listener = rebind(address).await;
        }
        let Some(open) = listener.as_ref() else {
            if setting_rx.changed().await.is_err() {
                return;
            }
            continue;
        };
        tokio::select! {
            accepted = open.accept() => {
                let Ok((client, _)) = accepted else { continue };
                counters.accepted.fetch_add(1, Ordering::Relaxed);
                connections.spawn(connection(
                    client,
                    upstream,
                    setting_rx.clone(),
                    Arc::clone(&counters),
                ));
            }
            changed = setting_rx.changed() => if changed.is_err() { return },
        }
    }
}

/// Listens on the proxy's port again after [`Fault::Refuse`] (the port is ours: nothing else
/// binds a port a test already handed out, but a moment may pass before the kernel lets go).
async fn rebind(address: SocketAddr) -> Option<TcpListener> {
    for _ in 0..100 {
        if let Ok(listener) = TcpListener::bind(address).await {
            return Some(listener);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the fault proxy cannot listen on {address} again");
}

/// Bytes a connection forwarded since the fault in force was set.
#[derive(Debug, Default)]
struct Budget {
    epoch: u64,
    used: u64,
}

/// Why a pump stopped.
enum PumpEnd {
    /// End of stream or an I/O error: the connection is over.
    Closed,
    /// The proxy cut the connection on purpose.
    Cut,
}

async fn connection(
    client: TcpStream,
    upstream: SocketAddr,
    setting_rx: watch::Receiver<Setting>,
    counters: Arc<Counters>,
) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_rx, client_tx) = client.into_split();
    let (server_rx, server_tx) = server.into_split();
    let budget = Arc::new(Mutex::new(Budget::default()));
    let end = tokio::select! {
        end = pump(client_rx, server_tx, setting_rx.clone(), Arc::clone(&budget)) => end,
        end = pump(server_rx, client_tx, setting_rx.clone(), Arc::clone(&budget)) => end,
        end = until_refused(setting_rx) => end,
    };
    if matches!(end, PumpEnd::Cut) {
        counters.cut.fetch_add(1, Ordering::Relaxed);
    }
    // Returning drops all four halves: both sockets close.
}

/// Ends when the proxy starts refusing, which also closes the live connections.
async fn until_refused(mut setting_rx: watch::Receiver<Setting>) -> PumpEnd {
    loop {
        if setting_rx.borrow_and_update().fault == Fault::Refuse {
            return PumpEnd::Cut;
        }
        if setting_rx.changed().await.is_err() {
            return PumpEnd::Closed;
        }
    }
}

async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut setting_rx: watch::Receiver<Setting>,
    budget: Arc<Mutex<Budget>>,
) -> PumpEnd {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return PumpEnd::Closed,
            Ok(n) => n,
        };
        let mut forward = n;
        let mut cut = false;
        loop {
            let setting = *setting_rx.borrow_and_update();
            match setting.fault {
                Fault::Pass => {}
                Fault::Delay(delay) => tokio::time::sleep(delay).await,
                Fault::Refuse => return PumpEnd::Cut,
                Fault::Blackhole => {
                    // Hold the chunk until the fault changes.
                    if setting_rx.changed().await.is_err() {
                        return PumpEnd::Closed;
                    }
                    continue;
                }
                Fault::CutAfter(limit) => {
                    let mut budget = budget.lock().expect("budget lock");
                    if budget.epoch != setting.epoch {
                        *budget = Budget {
                            epoch: setting.epoch,
                            used: 0,
                        };
                    }
                    let left = limit.saturating_sub(budget.used);
                    if (n as u64) >= left {
                        forward = usize::try_from(left).unwrap_or(n);
                        cut = true;
                    }
                    budget.used += forward as u64;
                }
            }
            break;
        }
        if to.write_all(&buf[..forward]).await.is_err() {
            return PumpEnd::Closed;
        }
        if cut {
            return PumpEnd::Cut;
        }
    }
}
