//! `fuzz-mutate`: the bounded fuzz run of the test command (tests/run.sh), without libFuzzer.
//!
//!     fuzz-mutate [--time SECONDS] [--seed N] [--dir FUZZ_DIR] [TARGET...]
//!
//! Runs each target (default: all) for SECONDS (default 30) on mutations of its committed seeds
//! and regressions (`switchyard_fuzz::mutate`), printing one line per target. An input that
//! panics is written to FUZZ_DIR/work/artifacts/<target>/ and the run exits 1; copy it to
//! FUZZ_DIR/regressions/<target>/ once the bug is fixed. Bad arguments exit 64.

use std::process::ExitCode;
use std::time::Duration;

use switchyard_fuzz::corpus::{committed, fuzz_dir};
use switchyard_fuzz::mutate::fuzz;
use switchyard_fuzz::{TARGETS, Target, target};

struct Args {
    seconds: u64,
    seed: u64,
    dir: std::path::PathBuf,
    targets: Vec<&'static Target>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        seconds: 30,
        seed: 1,
        dir: fuzz_dir(),
        targets: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--time" => {
                args.seconds = value("--time")?
                    .parse()
                    .map_err(|_| "--time must be a whole number of seconds".to_owned())?;
            }
            "--seed" => {
                args.seed = value("--seed")?
                    .parse()
                    .map_err(|_| "--seed must be a whole number".to_owned())?;
            }
            "--dir" => args.dir = value("--dir")?.into(),
            name => args.targets.push(target(name).ok_or_else(|| {
                let names: Vec<_> = TARGETS.iter().map(|t| t.name).collect();
                format!(
                    "unknown target or option '{name}' (targets: {})",
                    names.join(", ")
                )
            })?),
        }
    }
    if args.targets.is_empty() {
        args.targets = TARGETS.iter().collect();
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("fuzz-mutate: {message}");
            return ExitCode::from(64);
        }
    };
    let mut failed = false;
    for target in &args.targets {
        let seeds = match committed(&args.dir, target.name) {
            Ok(files) => files.into_iter().map(|(_, data)| data).collect::<Vec<_>>(),
            Err(err) => {
                eprintln!(
                    "fuzz-mutate: cannot read the inputs of {} under {}: {err}",
                    target.name,
                    args.dir.display()
                );
                return ExitCode::FAILURE;
            }
        };
        let outcome = fuzz(target, &seeds, Duration::from_secs(args.seconds), args.seed);
        let secs = outcome.elapsed.as_secs_f64();
        let rate = outcome.runs as f64 / secs.max(1e-9);
        let result = match &outcome.crash {
            None => "ok".to_owned(),
            Some(input) => {
                failed = true;
                match keep_crash(&args.dir, target.name, input) {
                    Ok(path) => format!("CRASH: input written to {path}"),
                    Err(err) => format!("CRASH: cannot write the input: {err}"),
                }
            }
        };
        println!(
            "fuzz-mutate: {:<18} {secs:.0}s  seeds {}  runs {}  exec/s {rate:.0}  {result}",
            target.name,
            seeds.len(),
            outcome.runs
        );
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn keep_crash(dir: &std::path::Path, target: &str, input: &[u8]) -> std::io::Result<String> {
    let out = dir.join("work").join("artifacts").join(target);
    std::fs::create_dir_all(&out)?;
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    input.hash(&mut hasher);
    let name = format!("crash-mutate-{:016x}", hasher.finish());
    let path = out.join(name);
    std::fs::write(&path, input)?;
    Ok(path.display().to_string())
}
