//! [`RedisServer`]: a real `redis-server` (Debian's `redis-server` package) on a free loopback
//! port, in memory only (no RDB, no AOF), killed when dropped.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{TestkitError, free_port, io_error};

/// How long [`RedisServer::start`] waits for the first answer to `PING`.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A `redis-server` on loopback.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    password: Option<String>,
    child: Option<Child>,
}

/// The binary: `$SWITCHYARD_REDIS_BIN`, else `redis-server` on `PATH`, else `/usr/bin`'s.
pub fn find_redis() -> Result<PathBuf, TestkitError> {
    if let Some(bin) = std::env::var_os("SWITCHYARD_REDIS_BIN") {
        return Ok(PathBuf::from(bin));
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("redis-server"))
        .chain([PathBuf::from("/usr/bin/redis-server")])
        .find(|candidate| candidate.is_file())
        .ok_or(TestkitError::RedisNotFound)
}

impl RedisServer {
    /// A Redis without a password.
    pub fn start() -> Result<Self, TestkitError> {
        Self::spawn(None)
    }

    /// A Redis that needs `password` (`requirepass`).
    pub fn start_with_password(password: &str) -> Result<Self, TestkitError> {
        Self::spawn(Some(password.to_owned()))
    }

    fn spawn(password: Option<String>) -> Result<Self, TestkitError> {
        let mut server = Self {
            port: free_port(),
            password,
            child: None,
        };
        server.restart()?;
        Ok(server)
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills it (SIGKILL, as a crash would); the counts are gone with it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again (empty) on the same port.
    pub fn restart(&mut self) -> Result<(), TestkitError> {
        self.stop();
        let mut command = Command::new(find_redis()?);
        command
            .args(["--bind", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"]);
        if let Some(password) = &self.password {
            command.args(["--requirepass", password]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(io_error("cannot start redis-server"))?;
        self.child = Some(child);
        let started = Instant::now();
        while started.elapsed() < START_TIMEOUT {
            if self.answers() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(TestkitError::RedisUnhealthy {
            port: self.port,
            waited: started.elapsed(),
        })
    }

    /// Whether it answers `PING` (with `PONG`, or `NOAUTH` when it has a password).
    fn answers(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        let mut reply = [0u8; 64];
        stream.write_all(b"PING\r\n").is_ok()
            && stream
                .read(&mut reply)
                .is_ok_and(|n| n > 0 && matches!(reply[0], b'+' | b'-'))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
