"""The checks of deploy/validate.sh that are easier in Python than in shell.

    split-crds RENDERED OUT SCHEMA_DIR   write RENDERED without custom resources to OUT and
                                         check each custom resource against SCHEMA_DIR
    dockerfile DOCKERFILE ROOT           the Dockerfile builds and copies the release binary
                                         `cargo build --release -p switchyard` makes
    linked-libs BINARY                   the binary links only what the runtime image holds
    run-args RENDERED BINARY             run BINARY with the arguments and environment the
                                         rendered chart gives each switchyard container
    planner RENDERED NAMESPACE           the planner's RBAC is exactly what its Kubernetes
                                         connector needs, and its flags name what the chart renders
    discovery RENDERED NAMESPACE         pods using Kubernetes discovery run as its account, whose
                                         one Role reads only pods and InferencePools

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
import threading
import time

import jsonschema
import yaml

# Kinds kubernetes-validate has no schema for, checked against our own subset schemas.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring.coreos.com-v1.json",
    # The endpoint picker variant (epp.enabled): from the upstream CRDs by crd_to_schema.py.
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-inference.networking.k8s.io-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-gateway.networking.k8s.io-v1.json",
    # Certificates (tls.certManager): from cert-manager's upstream CRDs by crd_to_schema.py.
    ("cert-manager.io/v1", "Certificate"): "certificate-cert-manager.io-v1.json",
    ("cert-manager.io/v1", "Issuer"): "issuer-cert-manager.io-v1.json",
}

# Shared libraries gcr.io/distroless/cc-debian12 provides (glibc, libgcc, libstdc++, OpenSSL 3).
RUNTIME_LIBS = {
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libgcc_s.so.1", "libstdc++.so.6",
    "libssl.so.3", "libcrypto.so.3",
}

# A process that got past its configuration and stopped at dialing the chart's etcd (whose
# Service name does not resolve here) has accepted every argument.
ETCD_UNREACHABLE = "cannot reach etcd"
# Or, since a member waits for the registry instead of exiting, that it logged the wait: it got
# past its configuration. Taken as soon as it is logged, so a container costs a second or so,
# not the whole timeout (which remains for those waiting on the Kubernetes API or an engine).
# (`switchyard-registry`'s retry and `etcd-auth`'s own).
REGISTRY_WAIT = (
    "the registry is unavailable; waiting for it",
    "etcd is not answering yet; retrying",
)
EXIT_CONFIG = 64
RUN_TIMEOUT_SECS = 20


def wait_accepted(command, **popen_args):
    """Runs COMMAND until it exits, logs one of REGISTRY_WAIT, or RUN_TIMEOUT_SECS pass (then it is
    killed). Returns (exit code, None when it was stopped; stderr; whether it logged the wait)."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, **popen_args)
    lines, waiting = [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if any(marker in line for marker in REGISTRY_WAIT):
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + RUN_TIMEOUT_SECS
    while proc.poll() is None and not waiting.is_set() and time.monotonic() < deadline:
        waiting.wait(0.05)
    code = proc.poll()
    if code is None:
        proc.kill()
        proc.wait()
    reader.join(timeout=5)
    return code, "".join(lines).strip(), waiting.is_set()


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
    # The build's system packages come from the one dependency script, copied in before it runs.
    deps_at = next((i for i, (ins, rest) in enumerate(builder)
                    if ins == "RUN" and re.search(r"(?:^|&&|;)\s*bash deploy/build-deps\.sh build\b", rest)), None)
    if deps_at is None:
        problems.append("the builder does not install its packages with `bash deploy/build-deps.sh build`")
    elif not any(ins == "COPY" and ("deploy/build-deps.sh" in rest.split()[:-1] or rest.split()[0] == ".")
                 for ins, rest in builder[:deps_at]):
        problems.append("the builder runs deploy/build-deps.sh before copying it in")
    else:
        print("  ok   the builder installs its packages through deploy/build-deps.sh build")
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


# A stand-in for the service account token a planner pod mounts: a kubeconfig whose API server
# nobody listens on. The Kubernetes connector sends no request when it is built, so the planner
# still gets as far as dialing etcd.
STANDIN_KUBECONFIG = """apiVersion: v1
kind: Config
current-context: validate
clusters:
- name: validate
  cluster:
    server: https://127.0.0.1:1
users:
- name: validate
  user:
    token: validate-sh-token
contexts:
- name: validate
  context:
    cluster: validate
    user: validate
"""


def lacks_subcommand(binary, name):
    """True when BINARY says it has no subcommand NAME (clap's own error)."""
    proc = subprocess.run([binary, name, "--help"], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_SECS)
    return proc.returncode != 0 and "unrecognized subcommand" in proc.stderr


def identity_uri(args):
    """The identity URI a member's certificate carries: its role in its cluster."""
    role = {"epp": "gateway"}.get(args[0], args[0]) if args else "worker"
    cluster = next((a.split("=", 1)[1] for a in args if a.startswith("--cluster=")), "default")
    return f"spiffe://switchyard/{cluster}/{role}"


def standin_certificate(directory, uri):
    """tls.crt, tls.key and ca.crt (itself) of a one-day self-signed certificate for `uri`."""
    directory.mkdir()
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=validate-sh",
         "-addext", f"subjectAltName=URI:{uri},DNS:localhost",
         "-keyout", str(directory / "tls.key"), "-out", str(directory / "tls.crt")],
        check=True, capture_output=True)
    (directory / "ca.crt").write_bytes((directory / "tls.crt").read_bytes())


def run_args(rendered, binary):
    docs = [d for d in yaml.safe_load_all(pathlib.Path(rendered).read_text()) if d]
    # The switchyard image is the gateway container's; worker containers run the same image.
    image = next(c["image"] for d in docs if d["kind"] == "Deployment"
                 for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway")
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    problems, ran = [], 0
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
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
            if args and lacks_subcommand(binary, args[0]):
                # Printed, not hidden: the check runs by itself once the binary has it.
                print(f"  SKIP {where}: this switchyard binary has no `{args[0]}` subcommand yet")
                continue
            with tempfile.TemporaryDirectory() as tmp:
                # Config files the chart mounts from ConfigMaps are written where the args say.
                for mount in container.get("volumeMounts", []):
                    secret = volumes.get(mount["name"], {}).get("secret")
                    if secret:
                        # A stand-in that reads as a cluster secret (16+ bytes) and as an API
                        # key list (one hashed key and its tenant) alike.
                        inside = mount["mountPath"].rstrip("/")
                        items = [item["path"] for item in secret.get("items", [])]
                        if "tls.crt" in items:
                            # A certificate Secret: a throwaway self-signed certificate naming
                            # the container's identity (members refuse one that names another).
                            local_dir = pathlib.Path(tmp, "tls-" + mount["name"])
                            standin_certificate(local_dir, identity_uri(args))
                            args = [a.replace(f"{inside}/", f"{local_dir}/") for a in args]
                            continue
                        for item in secret.get("items", []):
                            local = pathlib.Path(tmp, "secret-" + item["path"])
                            local.write_text("0" * 64 + " validate-sh\n")
                            args = [a.replace(f"{inside}/{item['path']}", str(local)) for a in args]
                        continue
                    cm = volumes.get(mount["name"], {}).get("configMap")
                    if not cm:
                        continue
                    for key, text in config_maps[cm["name"]].items():
                        inside = f"{mount['mountPath'].rstrip('/')}/{key}"
                        local = pathlib.Path(tmp, key)
                        local.write_text(text)
                        args = [a.replace(inside, str(local)) for a in args]
                run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, **env}
                if pod.get("automountServiceAccountToken"):
                    kubeconfig = pathlib.Path(tmp, "kubeconfig")
                    kubeconfig.write_text(STANDIN_KUBECONFIG)
                    run_env["KUBECONFIG"] = str(kubeconfig)
                code, stderr, waiting = wait_accepted([binary, *args], env=run_env, cwd=tmp)
            ran += 1
            if code == 1 and ETCD_UNREACHABLE in stderr or code is None:
                # Still running: waiting for etcd, the Kubernetes API (discovery) or an engine.
                if code == 1:
                    stopped = "stopped at etcd"
                elif waiting:
                    stopped = "waiting for the registry"
                else:
                    stopped = f"still waiting after {RUN_TIMEOUT_SECS}s"
                print(f"  ok   {where}: `switchyard {' '.join(args[:1])} …` ({len(args) - 1} args) accepted; {stopped}")
            else:
                last = stderr.splitlines()[-1] if stderr else "(no stderr)"
                problems.append(f"{where}: switchyard {shlex.join(args)} exited {code}: {last}")
    if ran == 0:
        problems.append(f"{rendered}: no container runs image {image}")
    if problems:
        fail(problems)


# What the Kubernetes connector sends: GET and PATCH of deployments/<name>/scale (apps). It never
# reads or writes the Deployment itself.
PLANNER_RULE_GROUPS = ["apps"]
PLANNER_RESOURCES = {"deployments/scale"}
PLANNER_VERBS = {"get", "patch"}


def flag_values(args):
    """--name=value and --name value pairs of an argument list (the last one of a flag wins)."""
    values, i = {}, 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
            values[name] = value
        elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            values[arg] = args[i + 1]
            i += 1
        i += 1
    return values


def pod_spec(doc):
    return doc["spec"]["template"]["spec"]


def component(doc):
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


IDENTITY_KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")


def check_planner(rendered, namespace):
    docs = [d for d in yaml.safe_load_all(pathlib.Path(rendered).read_text()) if d]
    # The discovery identity (gateway and picker reading pods) has its own check.
    discovery_accounts = {d["metadata"]["name"] for d in docs
                          if d["kind"] == "ServiceAccount" and component(d) == "discovery"}
    docs = [d for d in docs if not (d["kind"] in IDENTITY_KINDS and component(d) == "discovery")]
    by_kind = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    deployments = by_kind.get("Deployment", {})
    rbac = [f"{kind}/{name}" for kind in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
            for name in by_kind.get(kind, {})]
    planners = [(d, c) for d in deployments.values() for c in pod_spec(d)["containers"]
                if c.get("args", [])[:1] == ["planner"]]
    if not planners:
        if rbac:
            fail([f"{rendered}: no planner, yet RBAC objects {', '.join(rbac)}"])
        print("  ok   no planner and no RBAC objects")
        return
    if len(planners) != 1:
        fail([f"{rendered}: {len(planners)} planner containers, expected one"])
    problems = []
    deployment, container = planners[0]
    where = f"Deployment/{deployment['metadata']['name']}"
    flags = flag_values(container["args"])

    if flags.get("--connector") != "kubernetes":
        problems.append(f"{where}: --connector is {flags.get('--connector')!r}, not kubernetes")
    if flags.get("--kube-namespace") != namespace:
        problems.append(f"{where}: --kube-namespace is {flags.get('--kube-namespace')!r}, "
                        f"not the release namespace {namespace!r}")

    # The two Deployments it scales exist, are worker pools of the right role, and differ.
    scaled = {}
    for flag, role in (("--prefill-deployment", "prefill"), ("--decode-deployment", "decode")):
        name = flags.get(flag)
        target = deployments.get(name)
        if target is None:
            problems.append(f"{where}: {flag}={name} names no Deployment the chart renders "
                            f"(it renders {', '.join(sorted(deployments))})")
            continue
        worker_roles = [flag_values(c.get("args", [])).get("--role") for c in pod_spec(target)["containers"]
                        if c.get("args", [])[:1] == ["worker"]]
        if worker_roles != [role]:
            problems.append(f"{where}: {flag}={name} runs workers with roles {worker_roles}, not [{role!r}]")
        scaled[role] = name
    if len(set(scaled.values())) != len(scaled):
        problems.append(f"{where}: the prefill and decode deployments are the same Deployment")

    # The identity: its own service account, with the token mounted, bound to one Role.
    pod = pod_spec(deployment)
    account = pod.get("serviceAccountName")
    if account not in by_kind.get("ServiceAccount", {}):
        problems.append(f"{where}: service account {account!r} is not rendered by the chart")
    if pod.get("automountServiceAccountToken") is not True:
        problems.append(f"{where}: automountServiceAccountToken is not true; the connector needs the token")
    for other in [*deployments.values(), *by_kind.get("StatefulSet", {}).values()]:
        if other is deployment:
            continue
        other_pod = pod_spec(other)
        if other_pod.get("serviceAccountName") in discovery_accounts:
            continue
        if other_pod.get("serviceAccountName") == account:
            problems.append(f"{other['kind']}/{other['metadata']['name']} runs as the planner's account {account}")
        if other_pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{other['kind']}/{other['metadata']['name']} mounts a Kubernetes API token")
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        for name in by_kind.get(kind, {}):
            problems.append(f"{kind}/{name}: the chart grants nothing cluster-wide")

    bindings = [b for b in by_kind.get("RoleBinding", {}).values()
                if any(s.get("kind") == "ServiceAccount" and s.get("name") == account
                       and s.get("namespace") == namespace for s in b.get("subjects", []))]
    for name, binding in by_kind.get("RoleBinding", {}).items():
        if binding not in bindings:
            problems.append(f"RoleBinding/{name} binds something other than the planner's account")
    if len(bindings) != 1:
        problems.append(f"{where}: {len(bindings)} RoleBindings for {account}, expected one")
    granted = set()
    for binding in bindings:
        ref = binding["roleRef"]
        role = by_kind.get("Role", {}).get(ref["name"]) if ref.get("kind") == "Role" else None
        if role is None:
            problems.append(f"RoleBinding/{binding['metadata']['name']} refers to {ref.get('kind')}/{ref['name']}, "
                            "not a Role the chart renders")
            continue
        for rule in role.get("rules", []):
            what = f"Role/{ref['name']} rule {rule}"
            if rule.get("apiGroups") != PLANNER_RULE_GROUPS:
                problems.append(f"{what}: apiGroups must be {PLANNER_RULE_GROUPS}")
            extra = set(rule.get("resources", [])) - PLANNER_RESOURCES
            if extra or not rule.get("resources"):
                problems.append(f"{what}: grants {sorted(extra) or 'no resources'}; only deployments/scale is needed")
            extra = set(rule.get("verbs", [])) - PLANNER_VERBS
            if extra or not rule.get("verbs"):
                problems.append(f"{what}: grants verbs {sorted(extra) or 'none'}; only get and patch are needed")
            if set(rule.get("resourceNames", [])) != set(scaled.values()):
                problems.append(f"{what}: resourceNames {rule.get('resourceNames')} are not exactly "
                                f"the scaled Deployments {sorted(scaled.values())}")
            if rule.get("nonResourceURLs"):
                problems.append(f"{what}: grants non-resource URLs")
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    for name in rule.get("resourceNames", []):
                        granted.add((resource, verb, name))
    for name in scaled.values():
        for verb in sorted(PLANNER_VERBS):
            if ("deployments/scale", verb, name) not in granted:
                problems.append(f"{where}: no Role grants {verb} on deployments/scale of {name}; "
                                "the connector needs it")
    extra_roles = set(by_kind.get("Role", {})) - {b["roleRef"]["name"] for b in bindings}
    for name in sorted(extra_roles):
        problems.append(f"Role/{name} is rendered but not bound to the planner")

    # What else it is pointed at exists: etcd as the gateway has it, the gateway's Service,
    # the admin token, the probes on its admin listener.
    gateways = [c for d in deployments.values() for c in pod_spec(d)["containers"]
                if c.get("args", [])[:1] == ["gateway"]]
    if gateways and flags.get("--etcd") != flag_values(gateways[0]["args"]).get("--etcd"):
        problems.append(f"{where}: --etcd={flags.get('--etcd')} differs from the gateway's")
    gateway_url = re.fullmatch(r"(https?)://([a-z0-9-]+):([0-9]+)", flags.get("--gateway", ""))
    service = by_kind.get("Service", {}).get(gateway_url.group(2)) if gateway_url else None
    if service is None or int(gateway_url.group(3)) not in [p["port"] for p in service["spec"]["ports"]]:
        problems.append(f"{where}: --gateway={flags.get('--gateway')} is not a port of a Service the chart renders")
    # The scheme is the gateway's: https when it serves HTTPS, read with a CA.
    gateway_https = bool(gateways) and "--http-tls-cert" in flag_values(gateways[0]["args"])
    if gateway_url and (gateway_url.group(1) == "https") != gateway_https:
        problems.append(f"{where}: --gateway={flags.get('--gateway')} but the gateway serves "
                        f"{'HTTPS' if gateway_https else 'plain HTTP'}")
    if gateway_url and gateway_url.group(1) == "https" and "--gateway-ca" not in flags:
        problems.append(f"{where}: an https --gateway without --gateway-ca")
    admin_scheme = "HTTPS" if "--admin-tls-cert" in flags else "HTTP"
    tokens = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for c in (container, *gateways[:1])
              for e in c.get("env", []) if e["name"] == "SWITCHYARD_ADMIN_TOKEN"}
    if not tokens.get("SWITCHYARD_ADMIN_TOKEN"):
        problems.append(f"{where}: SWITCHYARD_ADMIN_TOKEN does not come from a Secret")
    admin = re.fullmatch(r"0\.0\.0\.0:([0-9]+)", flags.get("--admin-listen", ""))
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container.get(probe, {}).get("httpGet", {})
        port = ports.get(get.get("port"), get.get("port"))
        if not admin or get.get("path") != "/health" or port != int(admin.group(1)):
            problems.append(f"{where}: {probe} is not GET /health on the --admin-listen port")
        if get.get("scheme", "HTTP") != admin_scheme:
            problems.append(f"{where}: {probe} speaks {get.get('scheme', 'HTTP')} to an {admin_scheme} listener")

    if problems:
        fail(problems)
    print(f"  ok   {where}: scales {scaled.get('prefill')} (prefill) and {scaled.get('decode')} (decode) "
          f"in {namespace}; Role grants only get, patch on deployments/scale of those two")


# What Kubernetes discovery sends: list and watch of pods, get of the picker's InferencePool.
DISCOVERY_RULES = {("", "pods"), ("inference.networking.k8s.io", "inferencepools")}
DISCOVERY_VERBS = {"get", "list", "watch"}


def check_discovery(rendered, namespace):
    """Pods that find workers through the Kubernetes API run as the discovery account, with its
    token, bound to one Role that reads pods and InferencePools in the namespace and nothing
    else; and they do not use etcd. Without such pods there is no discovery identity."""
    docs = [d for d in yaml.safe_load_all(pathlib.Path(rendered).read_text()) if d]
    identity = {(d["kind"], d["metadata"]["name"]): d for d in docs
                if d["kind"] in IDENTITY_KINDS and component(d) == "discovery"}
    finders = [(d, c) for d in docs if d["kind"] == "Deployment" for c in pod_spec(d)["containers"]
               if "--discovery=kubernetes" in c.get("args", [])]
    if not finders:
        if identity:
            fail([f"{rendered}: no pod uses Kubernetes discovery, yet {sorted(identity)}"])
        print("  ok   no Kubernetes discovery and no discovery identity")
        return
    problems = []
    accounts = {name for kind, name in identity if kind == "ServiceAccount"}
    for deployment, container in finders:
        where = f"Deployment/{deployment['metadata']['name']} container {container['name']}"
        pod = pod_spec(deployment)
        if pod.get("serviceAccountName") not in accounts:
            problems.append(f"{where}: runs as {pod.get('serviceAccountName')!r}, not the discovery account")
        if pod.get("automountServiceAccountToken") is not True:
            problems.append(f"{where}: automountServiceAccountToken is not true; discovery needs the token")
        if any(a.startswith("--etcd") for a in container.get("args", [])):
            problems.append(f"{where}: uses etcd as well as Kubernetes discovery")
    for kind, name in identity:
        if kind.startswith("Cluster"):
            problems.append(f"{kind}/{name}: discovery grants nothing cluster-wide")
    bindings = [d for (kind, _), d in identity.items() if kind == "RoleBinding"]
    if len(bindings) != 1:
        problems.append(f"{len(bindings)} discovery RoleBindings, expected one")
    for binding in bindings:
        subjects = [(s.get("kind"), s.get("name"), s.get("namespace")) for s in binding.get("subjects", [])]
        if subjects != [("ServiceAccount", name, namespace) for name in sorted(accounts)]:
            problems.append(f"RoleBinding/{binding['metadata']['name']}: subjects {subjects} are not "
                            f"the discovery account in {namespace}")
        role = identity.get(("Role", binding["roleRef"]["name"]))
        if binding["roleRef"].get("kind") != "Role" or role is None:
            problems.append(f"RoleBinding/{binding['metadata']['name']}: not bound to a discovery Role")
            continue
        granted = set()
        for rule in role.get("rules", []):
            what = f"Role/{role['metadata']['name']} rule {rule}"
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    if (group, resource) not in DISCOVERY_RULES:
                        problems.append(f"{what}: grants {group or 'core'}/{resource}")
                    granted.add((group, resource))
            extra = set(rule.get("verbs", [])) - DISCOVERY_VERBS
            if extra:
                problems.append(f"{what}: grants verbs {sorted(extra)}; only get, list and watch are needed")
            if rule.get("nonResourceURLs"):
                problems.append(f"{what}: grants non-resource URLs")
        for missing in sorted(DISCOVERY_RULES - granted):
            problems.append(f"Role/{role['metadata']['name']}: does not grant {missing[1]}, which discovery reads")
    if problems:
        fail(problems)
    names = ", ".join(f"Deployment/{d['metadata']['name']}" for d, _ in finders)
    print(f"  ok   {names}: Kubernetes discovery as {', '.join(sorted(accounts))}; its Role reads only "
          f"pods and inferencepools in {namespace}; no etcd")


def main(argv):
    commands = {
        "split-crds": (split_crds, 3),
        "dockerfile": (check_dockerfile, 2),
        "linked-libs": (linked_libs, 1),
        "run-args": (run_args, 2),
        "planner": (check_planner, 2),
        "discovery": (check_discovery, 2),
    }
    if len(argv) < 2 or argv[1] not in commands or len(argv) - 2 != commands[argv[1]][1]:
        print(__doc__, file=sys.stderr)
        return 2
    func, _ = commands[argv[1]]
    func(*argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
