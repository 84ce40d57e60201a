//! [`NatsServer`]: a `nats-server` process with JetStream on a free loopback port, its store in
//! a directory of its own, stopped (and the store removed) when dropped. `switchyard up
//! --event-plane embedded` runs one; so do the tests (a real server, not a fake).

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::io::Read;

/// How long [`NatsServer::start`] waits for the server to greet a client.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a `nats-server` could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(
        "nats-server not found: install Debian's nats-server package, or set SWITCHYARD_NATS_SERVER_BIN"
    )]
    NotFound,
    #[error("cannot start nats-server: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("nats-server on port {port} did not answer within {waited:?}")]
    Unhealthy { port: u16, waited: Duration },
}

/// How clients must authenticate to the server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ServerAuth {
    /// Anyone who reaches the port.
    #[default]
    Open,
    User {
        user: String,
        password: String,
    },
    Token(String),
}

/// A running `nats-server -js` on `127.0.0.1`.
#[derive(Debug)]
pub struct NatsServer {
    port: u16,
    auth: ServerAuth,
    /// The largest message it takes, when not the server's default (1 MiB).
    max_payload: Option<u32>,
    store: PathBuf,
    child: Option<Child>,
}

/// The binary: `$SWITCHYARD_NATS_SERVER_BIN`, else `nats-server` on `PATH`, else Debian's
/// `/usr/sbin/nats-server`.
pub fn find_nats_server() -> Result<PathBuf, ServerError> {
    if let Some(bin) = std::env::var_os("SWITCHYARD_NATS_SERVER_BIN") {
        return Ok(PathBuf::from(bin));
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("nats-server"))
        .chain([
            PathBuf::from("/usr/sbin/nats-server"),
            PathBuf::from("/usr/bin/nats-server"),
        ])
        .find(|candidate| candidate.is_file())
        .ok_or(ServerError::NotFound)
}

impl NatsServer {
    /// Starts a server on a free loopback port (retried on another port if the one picked is
    /// taken before the server binds it) and waits until it greets a client.
    pub fn start(auth: ServerAuth) -> Result<Self, ServerError> {
        Self::start_with(auth, None)
    }

    /// [`Self::start`] with a `max_payload` of its own (bytes), from a configuration file in
    /// its store directory: what a deployment's NATS may set lower or higher than the default.
    pub fn start_with(auth: ServerAuth, max_payload: Option<u32>) -> Result<Self, ServerError> {
        let mut last = None;
        for _ in 0..3 {
            let mut server = Self {
                port: free_port(),
                auth: auth.clone(),
                max_payload,
                store: std::env::temp_dir().join(format!(
                    "switchyard-nats-{}-{}",
                    std::process::id(),
                    free_port()
                )),
                child: None,
            };
            match server.restart() {
                Ok(()) => return Ok(server),
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or(ServerError::NotFound))
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills it (SIGKILL, as a crash would); its store stays for [`Self::restart`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it (again) on the same port and store.
    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.stop();
        let mut command = Command::new(find_nats_server()?);
        command
            .args(["--jetstream", "--addr", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .arg("--store_dir")
            .arg(&self.store);
        if let Some(bytes) = self.max_payload {
            std::fs::create_dir_all(&self.store).map_err(ServerError::Spawn)?;
            let config = self.store.join("limits.conf");
            std::fs::write(&config, format!("max_payload: {bytes}\n"))
                .map_err(ServerError::Spawn)?;
            command.arg("--config").arg(config);
        }
        match &self.auth {
            ServerAuth::Open => {}
            ServerAuth::User { user, password } => {
                command.args(["--user", user, "--pass", password]);
            }
            ServerAuth::Token(token) => {
                command.args(["--auth", token]);
            }
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(ServerError::Spawn)?;
        self.child = Some(child);
        let started = Instant::now();
        while started.elapsed() < START_TIMEOUT {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(_)) = child.try_wait()
            {
                // Exited: the port was taken, or the flags refused.
                self.child = None;
                break;
            }
            if self.greets() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop();
        Err(ServerError::Unhealthy {
            port: self.port,
            waited: started.elapsed(),
        })
    }

    /// Whether it sends its `INFO` greeting to a new connection.
    fn greets(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        let mut greeting = [0u8; 4];
        stream.read_exact(&mut greeting).is_ok() && &greeting == b"INFO"
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or(0)
}
