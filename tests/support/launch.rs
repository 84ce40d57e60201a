//! Builders of the `switchyard` command lines the cross-process tests start: a worker or a
//! gateway in one etcd cluster, or a whole `up` stack. Each test names only the flags its
//! scenario is about; the connection flags every process of a cluster shares are written once.

use super::SwitchyardProcess;

/// One `switchyard <subcommand>` command line, started with [`Launch::start`].
#[derive(Debug, Clone)]
pub struct Launch {
    subcommand: &'static str,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Launch {
    /// `switchyard worker --etcd <etcd> --cluster <cluster>` (the simulator unless `--engine`).
    pub fn worker(etcd: &str, cluster: &str) -> Self {
        Self::new("worker")
            .arg("--etcd", etcd)
            .arg("--cluster", cluster)
    }

    /// `switchyard gateway --etcd <etcd> --cluster <cluster>` on a free loopback port.
    pub fn gateway(etcd: &str, cluster: &str) -> Self {
        Self::new("gateway")
            .arg("--etcd", etcd)
            .arg("--cluster", cluster)
            .arg("--http", "127.0.0.1:0")
    }

    /// `switchyard up --workers <workers>` (gateway and simulated workers in one process) on a
    /// free loopback port, its answers running to their `max_tokens` (`--mean-output-tokens
    /// 0`) so that tests can count tokens; [`Self::up_as_readme`] keeps `up`'s own default.
    pub fn up(workers: u32) -> Self {
        Self::up_as_readme(workers).arg("--mean-output-tokens", "0")
    }

    /// `switchyard up --workers <workers>` on a free loopback port with every other default as
    /// the README starts it (answers end as a model's do).
    pub fn up_as_readme(workers: u32) -> Self {
        Self::new("up")
            .arg("--http", "127.0.0.1:0")
            .arg("--workers", &workers.to_string())
    }

    /// Any subcommand, with no flags yet.
    pub fn new(subcommand: &'static str) -> Self {
        Self {
            subcommand,
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// `--role <role>`.
    pub fn role(self, role: &str) -> Self {
        self.arg("--role", role)
    }

    /// `--id <id>`.
    pub fn id(self, id: &str) -> Self {
        self.arg("--id", id)
    }

    /// `<flag> <value>`.
    pub fn arg(mut self, flag: &str, value: &str) -> Self {
        self.args.extend([flag.to_owned(), value.to_owned()]);
        self
    }

    /// Flags and values as they stand on a command line (a switch without a value included).
    pub fn args<S: AsRef<str>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// An environment variable of the child.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Starts the process and waits (bounded) for its ready line.
    pub async fn start(self) -> SwitchyardProcess {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        SwitchyardProcess::spawn_with_env(self.subcommand, &args, &env).await
    }
}
