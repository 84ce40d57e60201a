// Records the git revision the binary is built from, for `switchyard --version`:
// SWITCHYARD_GIT_REV from the environment when set (an image build without .git passes it as a
// build argument), else `git rev-parse` of the checkout, else "unknown" (a source tarball).
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (!text.is_empty()).then_some(text)
}

fn main() {
    println!("cargo:rerun-if-env-changed=SWITCHYARD_GIT_REV");
    let rev = std::env::var("SWITCHYARD_GIT_REV")
        .ok()
        .filter(|rev| !rev.is_empty())
        .or_else(|| {
            // Rebuild the string when HEAD moves: HEAD itself, the loose branch refs (a folder,
            // which cargo scans whole, so a branch's first loose ref counts too) and the packed
            // refs. Only paths that exist are watched: cargo reruns a build script whose watched
            // file is missing on every build (a fresh clone has no loose branch ref, and a
            // repository never packed has no packed-refs).
            for path in ["HEAD", "refs/heads", "packed-refs"] {
                if let Some(p) = git(&["rev-parse", "--git-path", path])
                    && std::path::Path::new(&p).exists()
                {
                    println!("cargo:rerun-if-changed={p}");
                }
            }
            git(&["rev-parse", "--short=12", "HEAD"])
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=SWITCHYARD_GIT_REV={rev}");
}
