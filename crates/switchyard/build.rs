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
            // Rebuild the string when HEAD moves: HEAD itself, the branch it points at, and the
            // packed refs a `git gc` moves that branch into.
            for path in ["HEAD", "packed-refs"] {
                if let Some(p) = git(&["rev-parse", "--git-path", path]) {
                    println!("cargo:rerun-if-changed={p}");
                }
            }
            if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
                && let Some(p) = git(&["rev-parse", "--git-path", &branch])
            {
                println!("cargo:rerun-if-changed={p}");
            }
            git(&["rev-parse", "--short=12", "HEAD"])
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=SWITCHYARD_GIT_REV={rev}");
}
