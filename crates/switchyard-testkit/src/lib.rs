//! Test support for Switchyard's cross-process tests.
//!
//! - [`free_port`] asks the kernel for a free loopback TCP port.
//! - [`EtcdServer`] runs a real, single-member etcd on free loopback ports with a throwaway data
//!   directory, and can stop and restart it on the same ports and data so tests can simulate
//!   "etcd was briefly down".
//! - [`redis::RedisServer`] runs a real, in-memory `redis-server` on a free loopback port.
//! - [`certs::TestCa`] makes a throwaway CA and member certificates for TLS and mTLS tests.
//!
//! Everything here is synchronous (`std::process`, `std::net`), so it works from plain tests and
//! from any async runtime alike (starting etcd blocks the calling thread for about a second).
//!
//! ```no_run
//! let etcd = switchyard_testkit::EtcdServer::start()?;
//! let endpoint = etcd.endpoint(); // "http://127.0.0.1:<port>"
//! # Ok::<(), switchyard_testkit::TestkitError>(())
//! ```

// Tests may unwrap: a failure there is the test failing.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod certs;
pub mod redis;

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long [`EtcdServer::start`] and [`EtcdServer::restart`] wait for etcd to report healthy.
/// Generous: on a shared 2-core machine under a full build, etcd's first WAL syncs alone have
/// taken over 20 s on disk (the data directory is on tmpfs where there is one, see
/// [`data_parent`]); a healthy etcd answers in well under a second, so only a failure waits.
pub const ETCD_START_TIMEOUT: Duration = Duration::from_secs(60);

/// Why the test support could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    #[error("etcd not found: install Debian's etcd-server (the README test command does)")]
    EtcdNotFound,
    #[error("redis-server not found: install Debian's redis-server (deploy/build-deps.sh test)")]
    RedisNotFound,
    #[error("redis-server on port {port} did not answer within {waited:?}")]
    RedisUnhealthy { port: u16, waited: Duration },
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("etcd at {endpoint} did not become healthy within {waited:?}; log tail:\n{log_tail}")]
    Unhealthy {
        endpoint: String,
        waited: Duration,
        log_tail: String,
    },
}

fn io_error(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> TestkitError {
    let context = context.into();
    move |source| TestkitError::Io { context, source }
}

/// A loopback TCP port that was free a moment ago (bind `127.0.0.1:0`, read the port, close).
///
/// Another process may take it before the caller binds it; callers that start servers on it
/// should retry on "address in use" (as [`EtcdServer::start`] does).
pub fn free_port() -> u16 {
    // Binding to port 0 on loopback only fails when the machine is out of ports or sockets, in
    // which case no test can run; a port of 0 then makes the caller's own bind fail loudly.
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or(0)
}

/// Where test etcd data directories go: `/dev/shm` (tmpfs) when the machine has it, so etcd's
/// fsyncs never wait behind other processes' disk writes; the system temporary directory
/// otherwise. Test data is thrown away with the server, so durability buys nothing here.
fn data_parent() -> PathBuf {
    let shm = Path::new("/dev/shm");
    let writable = shm.is_dir()
        && tempfile::Builder::new()
            .prefix("switchyard-probe-")
            .tempfile_in(shm)
            .is_ok();
    if writable {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// The etcd binary: `$SWITCHYARD_ETCD_BIN`, else `etcd` on `PATH`, else `/usr/bin/etcd`.
pub fn find_etcd() -> Result<PathBuf, TestkitError> {
    if let Some(bin) = std::env::var_os("SWITCHYARD_ETCD_BIN") {
        let bin = PathBuf::from(bin);
        return if bin.is_file() {
            Ok(bin)
        } else {
            Err(TestkitError::EtcdNotFound)
        };
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("etcd"))
        .find(|candidate| candidate.is_file());
    on_path
        .or_else(|| Some(PathBuf::from("/usr/bin/etcd")).filter(|p| p.is_file()))
        .ok_or(TestkitError::EtcdNotFound)
}

/// A single-member etcd on loopback, killed when dropped.
///
/// Its data directory and log (`etcd.log`) live in a temporary directory that is removed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    bin: PathBuf,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    /// Client TLS (server certificate, key, and the CA client certificates must chain to).
    tls: Option<EtcdTls>,
    /// Where `/health` is asked when the client port speaks TLS.
    metrics_port: u16,
}

/// The files of an etcd whose client port speaks TLS and wants client certificates.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl EtcdServer {
    /// Starts etcd on two free loopback ports and waits until it reports healthy.
    ///
    /// Retries with fresh ports when another process grabbed one of them first.
    pub fn start() -> Result<Self, TestkitError> {
        Self::start_with(None)
    }

    /// [`start`](Self::start) with the client port on TLS, requiring client certificates
    /// signed by `tls.ca` (`--client-cert-auth`); the endpoint is then `https://`.
    pub fn start_tls(tls: EtcdTls) -> Result<Self, TestkitError> {
        Self::start_with(Some(tls))
    }

    fn start_with(tls: Option<EtcdTls>) -> Result<Self, TestkitError> {
        let bin = find_etcd()?;
        let dir = tempfile::Builder::new()
            .prefix("switchyard-etcd-")
            .tempdir_in(data_parent())
            .map_err(io_error("cannot create a temporary directory for etcd"))?;
        let mut server = Self {
            bin,
            dir,
            client_port: 0,
            peer_port: 0,
            child: None,
            tls,
            metrics_port: 0,
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            server.client_port = free_port();
            server.peer_port = free_port();
            while server.peer_port == server.client_port {
                server.peer_port = free_port();
            }
            server.metrics_port = free_port();
            match server.spawn_and_wait() {
                Ok(()) => return Ok(server),
                Err(TestkitError::Unhealthy { log_tail, .. })
                    if attempt < 3 && log_tail.contains("address already in use") =>
                {
                    server.stop();
                    // A half-started member leaves data behind that names the old ports.
                    let _ = std::fs::remove_dir_all(server.data_dir());
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// The client URL, `http://127.0.0.1:<port>` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The running etcd's process id (for CPU and memory figures of benchmarks).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// The file etcd's stdout and stderr go to.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// Kills etcd (SIGKILL, as a crash would) and waits for it to exit. Data is kept.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes etcd (SIGSTOP), as a stalled disk, a long GC pause or a frozen VM would: its
    /// sockets stay open but nothing answers. [`resume`](Self::resume) thaws it.
    pub fn pause(&mut self) -> Result<(), TestkitError> {
        self.signal("STOP")
    }

    /// Thaws etcd after [`pause`](Self::pause) (SIGCONT).
    pub fn resume(&mut self) -> Result<(), TestkitError> {
        self.signal("CONT")
    }

    fn signal(&mut self, signal: &str) -> Result<(), TestkitError> {
        let Some(child) = self.child.as_ref() else {
            return Ok(());
        };
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status()
            .map_err(io_error(format!("cannot send SIG{signal} to etcd")))?;
        if status.success() {
            Ok(())
        } else {
            Err(TestkitError::Io {
                context: format!("cannot send SIG{signal} to etcd"),
                source: std::io::Error::other(format!("kill exited with {status}")),
            })
        }
    }

    /// Stops etcd if it runs, then starts it again on the same ports and data directory.
    pub fn restart(&mut self) -> Result<(), TestkitError> {
        self.stop();
        self.spawn_and_wait()
    }

    /// Kills etcd (SIGKILL), deletes its data directory and starts it again on the same ports:
    /// an etcd that lost everything (a member replaced, a volume lost). Leases, keys and
    /// revisions start again from nothing.
    pub fn restart_empty(&mut self) -> Result<(), TestkitError> {
        self.stop();
        match std::fs::remove_dir_all(self.data_dir()) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(io_error("cannot delete etcd's data directory")(error)),
        }
        self.spawn_and_wait()
    }

    /// Whether the etcd process is running (it may not be healthy yet).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn spawn_and_wait(&mut self) -> Result<(), TestkitError> {
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(io_error("cannot create the etcd log file"))?;
        let log_err = log
            .try_clone()
            .map_err(io_error("cannot duplicate the etcd log file handle"))?;
        let mut command = Command::new(&self.bin);
        if let Some(tls) = &self.tls {
            command
                .arg(format!("--cert-file={}", tls.cert.display()))
                .arg(format!("--key-file={}", tls.key.display()))
                .arg(format!("--trusted-ca-file={}", tls.ca.display()))
                .arg("--client-cert-auth")
                .arg(format!(
                    "--listen-metrics-urls=http://127.0.0.1:{}",
                    self.metrics_port
                ));
        }
        let child = command
            .arg("--name=default")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=default={peer_url}"))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(io_error(format!(
                "cannot start etcd from {}",
                self.bin.display()
            )))?;
        self.child = Some(child);
        self.wait_healthy()
    }

    fn wait_healthy(&mut self) -> Result<(), TestkitError> {
        let started = Instant::now();
        let port = if self.tls.is_some() {
            self.metrics_port
        } else {
            self.client_port
        };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        while started.elapsed() < ETCD_START_TIMEOUT {
            if !self.is_running() {
                break;
            }
            if health_check(addr) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(TestkitError::Unhealthy {
            endpoint: self.endpoint(),
            waited: started.elapsed(),
            log_tail: log_tail(&self.log_path(), 30),
        })
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `GET /health` over a plain TCP connection; true when etcd answers `"health":"true"`.
fn health_check(addr: SocketAddr) -> bool {
    let timeout = Duration::from_millis(500);
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let request = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.starts_with("HTTP/1.") && response.contains(r#""health":"true""#)
}

/// The last `lines` lines of a log file, or a note saying why there are none.
fn log_tail(path: &Path, lines: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(error) => format!("(cannot read {}: {error})", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_nonzero_and_bindable() {
        let port = free_port();
        assert_ne!(port, 0);
        assert!(TcpListener::bind(("127.0.0.1", port)).is_ok());
    }

    #[test]
    fn etcd_starts_restarts_and_stops() {
        let mut etcd = EtcdServer::start().unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], etcd.client_port()));
        assert!(health_check(addr));
        etcd.stop();
        assert!(!health_check(addr));
        etcd.restart().unwrap();
        assert!(health_check(addr));
        assert!(etcd.endpoint().starts_with("http://127.0.0.1:"));
    }

    #[test]
    fn log_tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        std::fs::write(&path, "a\nb\nc\n").unwrap();
        assert_eq!(log_tail(&path, 2), "b\nc");
        assert!(log_tail(&dir.path().join("missing"), 2).contains("cannot read"));
    }
}
