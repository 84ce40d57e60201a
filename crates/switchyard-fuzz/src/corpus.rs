//! The committed fuzz inputs: `fuzz/corpus/<target>/` (seeds) and `fuzz/regressions/<target>/`
//! (every crash ever found, kept after its fix).

use std::path::{Path, PathBuf};

/// The `fuzz/` directory of the checkout this crate was built from.
pub fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// The files directly in `dir`, sorted by name, with their bytes; none when `dir` does not
/// exist.
pub fn inputs(dir: &Path) -> std::io::Result<Vec<(PathBuf, Vec<u8>)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(err),
    };
    let mut paths = Vec::new();
    for entry in entries {
        let path = entry?.path();
        if path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    paths
        .into_iter()
        .map(|path| std::fs::read(&path).map(|data| (path, data)))
        .collect()
}

/// The seeds and regressions of `target` under `fuzz_dir`.
pub fn committed(fuzz_dir: &Path, target: &str) -> std::io::Result<Vec<(PathBuf, Vec<u8>)>> {
    let mut all = inputs(&fuzz_dir.join("corpus").join(target))?;
    all.extend(inputs(&fuzz_dir.join("regressions").join(target))?);
    Ok(all)
}
