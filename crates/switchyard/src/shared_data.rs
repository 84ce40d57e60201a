//! Where the replay commands find their default traces: the project's shared data directory,
//! whatever the current directory is.

use std::path::{Path, PathBuf};

/// The default Mooncake conversation trace, relative to the shared data directory.
pub const MOONCAKE_TRACE: &str = "traces/mooncake/conversation_trace.jsonl";
/// The default AgentX/Weka sessions, relative to the shared data directory.
pub const AGENTX_TRACE: &str = "agentx/weka_kv_cache_tester/dev_120.jsonl.gz";
/// The held-out AgentX/Weka sessions, relative to the shared data directory.
pub const AGENTX_B_TRACE: &str = "agentx/weka_kv_cache_tester/dev_b_120.jsonl.gz";

/// The shared data directories looked in, in order: `$SWITCHYARD_DATA` (read by clap into
/// `data_dir`), `../shared/data` from the current directory (a checkout's root), and
/// `../shared/data` beside the checkout this binary was built from.
pub fn candidates(data_dir: Option<&Path>) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = data_dir {
        dirs.push(dir.to_owned());
    }
    dirs.push(PathBuf::from("../shared/data"));
    // crates/switchyard → the workspace root → its sibling `shared/`.
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"));
    dirs
}

/// The trace to read: `given` when the user passed one, else `default` (relative to the shared
/// data directory) in the first candidate directory that has it. The error names the flag.
pub fn resolve_trace(
    given: Option<PathBuf>,
    default: &str,
    data_dir: Option<&Path>,
    flag: &str,
) -> Result<PathBuf, String> {
    if let Some(path) = given {
        return Ok(path);
    }
    let dirs = candidates(data_dir);
    dirs.iter()
        .map(|dir| dir.join(default))
        .find(|path| path.is_file())
        .map(|path| std::fs::canonicalize(&path).unwrap_or(path))
        .ok_or_else(|| {
            let looked: Vec<String> = dirs
                .iter()
                .map(|d| d.join(default).display().to_string())
                .collect();
            format!(
                "no default trace found (looked in {}); pass {flag} PATH or set SWITCHYARD_DATA to the shared data directory",
                looked.join(", ")
            )
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn a_given_path_wins_and_a_data_dir_is_looked_in_first() {
        let dir = tempfile::tempdir().unwrap();
        let given = dir.path().join("mine.jsonl");
        assert_eq!(
            resolve_trace(Some(given.clone()), MOONCAKE_TRACE, None, "--trace").unwrap(),
            given
        );
        let trace = dir.path().join(MOONCAKE_TRACE);
        std::fs::create_dir_all(trace.parent().unwrap()).unwrap();
        std::fs::write(&trace, "{}\n").unwrap();
        assert_eq!(
            resolve_trace(None, MOONCAKE_TRACE, Some(dir.path()), "--trace").unwrap(),
            trace
        );
    }

    #[test]
    fn a_missing_default_names_the_flag_and_where_it_looked() {
        let dir = tempfile::tempdir().unwrap();
        let err =
            resolve_trace(None, "no/such/trace.jsonl", Some(dir.path()), "--trace").unwrap_err();
        assert!(err.contains("pass --trace PATH"), "{err}");
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
    }

    #[test]
    fn the_build_checkout_default_does_not_depend_on_the_current_directory() {
        // The candidate beside the build checkout is absolute, so it holds from any directory.
        let beside_checkout = candidates(None).pop().unwrap();
        assert!(
            beside_checkout.is_absolute(),
            "{}",
            beside_checkout.display()
        );
    }
}
