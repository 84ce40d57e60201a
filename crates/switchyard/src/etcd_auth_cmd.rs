//! `switchyard etcd-auth`: turns on etcd's own users for one cluster, idempotently (the Helm
//! chart runs it as a Job on every install and upgrade). The members' user gets read and write
//! on `/switchyard/v1/<cluster>/` only; `root` exists without a password, so only a client
//! certificate whose common name is `root` (etcd's `--client-cert-auth`) acts as it. See
//! `docs/security.md`, "etcd".

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use switchyard_registry::RegistryError;
use switchyard_registry::etcd::users::set_up_cluster_user;

use crate::{EXIT_CONFIG, runtime};

/// Longest the whole setup may take (etcd starting next to the Job is waited for by retries).
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// Pause between attempts while etcd is not answering yet.
const RETRY_PAUSE: Duration = Duration::from_secs(2);

#[derive(Debug, clap::Args)]
pub struct EtcdAuthCommand {
    /// etcd endpoints, comma-separated.
    #[arg(long, value_delimiter = ',', env = "SWITCHYARD_ETCD", required = true)]
    etcd: Vec<String>,
    /// Registry namespace whose prefix the user may use.
    #[arg(long, env = "SWITCHYARD_CLUSTER", default_value = "default")]
    cluster: String,
    /// The user the members log in as (their --etcd-username).
    #[arg(long, default_value = "switchyard")]
    user: String,
    /// File holding that user's password (the members' --etcd-password-file).
    #[arg(long, env = "SWITCHYARD_ETCD_USER_PASSWORD_FILE")]
    user_password_file: PathBuf,
    /// How to reach etcd as root: --etcd-ca, and --etcd-cert/--etcd-key of a certificate whose
    /// common name is `root`.
    #[command(flatten)]
    security: switchyard_security::SecurityArgs,
}

pub fn run(command: EtcdAuthCommand) -> ExitCode {
    let mut security = switchyard_security::SecurityConfig::default();
    command.security.apply(&mut security);
    let settings = security
        .etcd_auth()
        .map_err(|e| e.to_string())
        .and_then(|admin| {
            let password = std::fs::read_to_string(&command.user_password_file).map_err(|e| {
                format!(
                    "cannot read the user's password file {}: {e}",
                    command.user_password_file.display()
                )
            })?;
            let password = password.trim_end_matches(['\r', '\n']).to_owned();
            if password.is_empty() {
                return Err(format!(
                    "the user's password file {} is empty",
                    command.user_password_file.display()
                ));
            }
            Ok((admin, password))
        });
    let (admin, password) = match settings {
        Ok(settings) => settings,
        Err(err) => {
            eprintln!("switchyard etcd-auth: {err}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let Some(runtime) = runtime() else {
        return ExitCode::FAILURE;
    };
    let endpoints = command.etcd.join(",");
    switchyard_security::install_crypto_provider();
    let setup = async {
        loop {
            match set_up_cluster_user(
                &command.etcd,
                &admin,
                &command.cluster,
                &command.user,
                &password,
            )
            .await
            {
                Err(err) if err.is_retryable() => {
                    tracing::info!(error = %err, "etcd is not answering yet; retrying");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                done => return done,
            }
        }
    };
    let outcome = runtime.block_on(async { tokio::time::timeout(SETUP_TIMEOUT, setup).await });
    match outcome {
        Ok(Ok(setup)) => {
            let done = serde_json::json!({
                "event": "done",
                "cluster": command.cluster,
                "user": command.user,
                "created": setup.created,
            });
            println!("{done}");
            ExitCode::SUCCESS
        }
        Ok(Err(err @ RegistryError::InvalidCluster(_) | err @ RegistryError::InvalidUser(_))) => {
            eprintln!("switchyard etcd-auth: {err}");
            ExitCode::from(EXIT_CONFIG)
        }
        Ok(Err(err)) => {
            eprintln!("switchyard etcd-auth: cannot set up users at {endpoints}: {err}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!(
                "switchyard etcd-auth: cannot reach etcd at {endpoints} within {} s",
                SETUP_TIMEOUT.as_secs()
            );
            ExitCode::FAILURE
        }
    }
}
