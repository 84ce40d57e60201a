"""The checks of deploy/validate.sh that are easier in Python than in shell.

    split-crds RENDERED OUT SCHEMA_DIR   write RENDERED without custom resources to OUT and
                                         check each custom resource against SCHEMA_DIR
    dockerfile DOCKERFILE ROOT           the Dockerfile builds and copies the release binary
                                         `cargo build --release -p switchyard` makes
    linked-libs BINARY                   the binary links only what the runtime image holds
    run-args RENDERED BINARY             run BINARY with the arguments and environment the
                                         rendered chart gives each switchyard container

Each prints what it checked and exits 1 with one sentence per problem.
Runs under the tools venv of validate.sh (PyYAML and jsonschema come with its packages).
"""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

import jsonschema
import yaml

# Kinds kubernetes-validate has no schema for, checked against our own subset schemas.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json"}

# Shared libraries gcr.io/distroless/cc-debian12 provides (glibc, libgcc, libstdc++, OpenSSL 3).
RUNTIME_LIBS = {
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libgcc_s.so.1", "libstdc++.so.6",
    "libssl.so.3", "libcrypto.so.3",
}

# A process that got past its configuration and stopped at dialing the chart's etcd (whose
# Service name does not resolve here) has accepted every argument.
ETCD_UNREACHABLE = "cannot reach etcd"
EXIT_CONFIG = 64
RUN_TIMEOUT_SECS = 20


def fail(problems):
    for problem in problems:
        print(f"  FAIL {problem}", file=sys.stderr)
    sys.exit(1)


def split_crds(rendered, out, schema_dir):
    docs = [d for d in yaml.safe_load_all(pathlib.Path(rendered).read_text()) if d]
    keep, problems = [], []
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key not in CUSTOM_KINDS:
            keep.append(doc)
            continue
        schema = json.loads((pathlib.Path(schema_dir) / CUSTOM_KINDS[key]).read_text())
        name = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str)
        for error in errors:
            path = ".".join(str(p) for p in error.absolute_path)
            problems.append(f"{rendered}: {name} at {path or '(top)'}: {error.message}")
        if not errors:
            print(f"  ok   {name} against {CUSTOM_KINDS[key]}")
    pathlib.Path(out).write_text(yaml.safe_dump_all(keep, sort_keys=False))
    if problems:
        fail(problems)


def dockerfile_instructions(path):
    """(stage index, instruction, argument text) with continuation lines joined."""
    lines, current = [], ""
    for raw in pathlib.Path(path).read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        lines.append(current)
        current = ""
    stage, out = -1, []
    for line in lines:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            stage += 1
        out.append((stage, instruction, rest.strip()))
    return out


def check_dockerfile(dockerfile, root):
    problems = []
    instructions = dockerfile_instructions(dockerfile)
    froms = [rest for _, ins, rest in instructions if ins == "FROM"]
    if len(froms) < 2:
        fail([f"{dockerfile}: expected a builder stage and a runtime stage, found {len(froms)} FROM"])
    builder_from, runtime_from = froms[0], froms[-1]
    builder_name = builder_from.split()[-1] if " AS " in builder_from.upper() else None

    # The builder's Rust is the workspace's rust-version.
    cargo_toml = (pathlib.Path(root) / "Cargo.toml").read_text()
    rust_version = re.search(r'^rust-version\s*=\s*"([^"]+)"', cargo_toml, re.M).group(1)
    if not builder_from.startswith(f"rust:{rust_version}-"):
        problems.append(f"builder image {builder_from.split()[0]} is not rust:{rust_version}-* (Cargo.toml rust-version)")

    builder = [(ins, rest) for stage, ins, rest in instructions if stage == 0]
    runs = " ".join(rest for ins, rest in builder if ins == "RUN")
    if "protobuf-compiler" not in runs:
        problems.append("the builder does not install protobuf-compiler (protoc)")
    build = re.search(r"cargo build ([^&;]*)", runs)
    build_args = shlex.split(build.group(1)) if build else []
    if not build or "--release" not in build_args or not ({"-p", "switchyard"} <= set(build_args) or "--package=switchyard" in build_args):
        problems.append("the builder does not run `cargo build --release -p switchyard`")
    for ins, rest in builder:
        if ins in ("ENV", "ARG") and re.search(r"CARGO_(TARGET_DIR|BUILD_TARGET\b|BUILD_TARGET_DIR)", rest):
            problems.append(f"the builder sets {rest.split('=')[0]}, which moves the release binary")
        if ins == "RUN" and "cargo build" in rest and ("--target " in rest or "--target=" in rest or "--profile" in rest):
            problems.append("the builder's cargo build changes the output directory (--target/--profile)")
    workdirs = [rest for ins, rest in builder if ins == "WORKDIR"]
    workdir = workdirs[-1] if workdirs else "/"

    # Where cargo puts the release binary, as cargo itself reports it for this workspace with no
    # target-dir override (the Docker build has none).
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARGO_TARGET_DIR") and k != "CARGO_BUILD_TARGET_DIR"}
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps", "--locked"],
        cwd=root, env=env, check=True, capture_output=True, text=True).stdout)
    target_rel = os.path.relpath(meta["target_directory"], meta["workspace_root"])
    package = next((p for p in meta["packages"] if p["name"] == "switchyard"), None)
    bins = [t["name"] for t in (package or {}).get("targets", []) if "bin" in t["kind"]]
    if bins != ["switchyard"]:
        problems.append(f"package switchyard has binaries {bins}, expected exactly [switchyard]")
    release_binary = os.path.normpath(os.path.join(workdir, target_rel, "release", "switchyard"))

    runtime = [(ins, rest) for stage, ins, rest in instructions if stage == len(froms) - 1]
    copies = [rest.split() for ins, rest in runtime if ins == "COPY" and f"--from={builder_name}" in rest]
    if len(copies) != 1:
        fail(problems + [f"the runtime stage should COPY exactly one file --from={builder_name}, found {len(copies)}"])
    copy_src, copy_dst = copies[0][-2], copies[0][-1]
    if os.path.normpath(copy_src) != release_binary:
        problems.append(f"COPY takes {copy_src}, but cargo build --release -p switchyard writes {release_binary}")
    else:
        print(f"  ok   COPY --from={builder_name} {copy_src}: cargo's release binary (target dir {target_rel}/ under WORKDIR {workdir})")

    entrypoint = [json.loads(rest) for ins, rest in runtime if ins == "ENTRYPOINT"]
    if entrypoint != [[copy_dst]]:
        problems.append(f"ENTRYPOINT should be the exec form [\"{copy_dst}\"], found {entrypoint}")
    users = [rest for ins, rest in runtime if ins == "USER"]
    user = users[-1] if users else ("nonroot" if runtime_from.endswith(":nonroot") else "root")
    if user.split(":")[0] in ("root", "0"):
        problems.append(f"the runtime stage runs as {user}")
    if not (runtime_from.startswith("gcr.io/distroless/cc-debian12") or runtime_from.startswith("debian:bookworm-slim")):
        problems.append(f"runtime base {runtime_from} is neither distroless/cc-debian12 nor debian:bookworm-slim")
    if problems:
        fail(problems)
    print(f"  ok   runtime {runtime_from}, user {user}, ENTRYPOINT [\"{copy_dst}\"]")


def linked_libs(binary):
    out = subprocess.run(["readelf", "-d", binary], check=True, capture_output=True, text=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    missing = [lib for lib in needed if lib not in RUNTIME_LIBS]
    if missing:
        fail([f"{binary} links {', '.join(missing)}, which gcr.io/distroless/cc-debian12 does not ship"])
    print(f"  ok   {binary} links only {', '.join(needed)} (all in distroless/cc-debian12)")


def expand(value, env):
    # Kubernetes expands $(VAR) from the container's env; $$(VAR) is a literal.
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def container_env(container, pod_name):
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        source = var.get("valueFrom", {})
        field = source.get("fieldRef", {}).get("fieldPath")
        if field == "status.podIP":
            env[var["name"]] = "127.0.0.1"
        elif field == "metadata.name":
            env[var["name"]] = pod_name
        elif "secretKeyRef" in source:
            env[var["name"]] = "validate-sh-token"
        else:
            raise ValueError(f"no stand-in for env {var['name']} from {source}")
    return env


def run_args(rendered, binary):
    docs = [d for d in yaml.safe_load_all(pathlib.Path(rendered).read_text()) if d]
    # The switchyard image is the gateway container's; worker containers run the same image.
    image = next(c["image"] for d in docs if d["kind"] == "Deployment"
                 for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway")
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    problems, ran = [], 0
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            if container["image"] != image:
                continue
            where = f"{doc['kind']}/{doc['metadata']['name']} container {container['name']}"
            if "command" in container:
                problems.append(f"{where} overrides the image ENTRYPOINT with command:")
                continue
            env = container_env(container, f"{doc['metadata']['name']}-0")
            args = [expand(a, env) for a in container.get("args", [])]
            with tempfile.TemporaryDirectory() as tmp:
                # Config files the chart mounts from ConfigMaps are written where the args say.
                for mount in container.get("volumeMounts", []):
                    cm = volumes.get(mount["name"], {}).get("configMap")
                    if not cm:
                        continue
                    for key, text in config_maps[cm["name"]].items():
                        inside = f"{mount['mountPath'].rstrip('/')}/{key}"
                        local = pathlib.Path(tmp, key)
                        local.write_text(text)
                        args = [a.replace(inside, str(local)) for a in args]
                run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, **env}
                try:
                    proc = subprocess.run([binary, *args], env=run_env, capture_output=True,
                                          text=True, timeout=RUN_TIMEOUT_SECS, cwd=tmp)
                    code, stderr = proc.returncode, proc.stderr.strip()
                except subprocess.TimeoutExpired:
                    code, stderr = None, f"still running after {RUN_TIMEOUT_SECS}s"
            ran += 1
            if code == 1 and ETCD_UNREACHABLE in stderr or code is None:
                print(f"  ok   {where}: `switchyard {' '.join(args[:1])} …` ({len(args) - 1} args) accepted; stopped at etcd")
            else:
                last = stderr.splitlines()[-1] if stderr else "(no stderr)"
                problems.append(f"{where}: switchyard {shlex.join(args)} exited {code}: {last}")
    if ran == 0:
        problems.append(f"{rendered}: no container runs image {image}")
    if problems:
        fail(problems)


def main(argv):
    commands = {
        "split-crds": (split_crds, 3),
        "dockerfile": (check_dockerfile, 2),
        "linked-libs": (linked_libs, 1),
        "run-args": (run_args, 2),
    }
    if len(argv) < 2 or argv[1] not in commands or len(argv) - 2 != commands[argv[1]][1]:
        print(__doc__, file=sys.stderr)
        return 2
    func, _ = commands[argv[1]]
    func(*argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
