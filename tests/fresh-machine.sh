#!/usr/bin/env bash
# The fresh-machine check: builds, tests and runs Switchyard in a minimal Debian bookworm root,
# the way a new user's machine is (the Rust toolchain, git, python3 with pip, curl and gcc;
# nothing else), so a missing install step fails here and not on a user's machine.
#
#   tests/fresh-machine.sh           the README's two commands exactly as written: the test
#                                    command, then the run command until /v1/models answers and
#                                    one chat completion succeeds (≈ 30 min on 2 cores)
#   tests/fresh-machine.sh --quick   the dependency script and every build script (cargo check of
#                                    the whole workspace): what the test command runs each time
#
# How: mmdebstrap --variant=minbase from the mirror apt already uses (/etc/apt/sources.list.d/
# or sources.list), cached as a tarball under ${XDG_CACHE_HOME:-~/.cache}/switchyard/fresh-root
# and unpacked afresh each run; the host's Rust toolchain (RUSTUP_HOME and cargo-nextest)
# bind-mounted read-only; a fresh CARGO_HOME; the checkout copied in (committed files plus the
# working tree's changes, ignored files left out), with the project's shared data (../shared)
# beside it read-only, as on the project's machines. The run command gets a network namespace of
# its own (loopback only, after the test command has fetched every crate), so the README's
# default port 8000 is free whatever the host runs. Needs root (mounts, chroot); prints the wall
# time of each step. Pass --keep to leave the root in place for a look afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$(pwd)

quick=0
keep=0
stage=""
for arg in "$@"; do
  case "$arg" in
    --stage=*) stage=${arg#--stage=} ;;
    --quick) quick=1 ;;
    --keep) keep=1 ;;
    -h | --help)
      sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "fresh-machine.sh: unknown argument '$arg' (expected --quick or --keep)" >&2
      exit 64
      ;;
  esac
done

# ---- stages run by this script itself, inside namespaces it made ----
in_root() {
  chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
    PATH=/opt/cargo-bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    RUSTUP_HOME=/opt/rustup RUSTUP_AUTO_INSTALL=0 CARGO_HOME=/root/.cargo-fresh \
    SWITCHYARD_FRESH_ROOT=1 bash -euo pipefail -c "cd /root/switchyard; $1"
}
timed() {
  local name=$1 started=$SECONDS
  shift
  echo "fresh-machine: $name ..." >&2
  "$@"
  echo "fresh-machine: $name: $((SECONDS - started)) s" >&2
}

# In a private mount namespace: the root's mounts, then the steps.
stage_mounted() {
  for d in proc sys dev opt/rustup opt/cargo-bin; do mkdir -p "$root/$d"; done
  mount -t proc proc "$root/proc"
  mount --rbind /sys "$root/sys"
  mount --rbind /dev "$root/dev"
  mount --bind "$rustup_home" "$root/opt/rustup"
  mount -o remount,bind,ro "$root/opt/rustup"
  mount --bind "$cargo_bin" "$root/opt/cargo-bin"
  mount -o remount,bind,ro "$root/opt/cargo-bin"
  if [ -n "$nextest" ]; then
    touch "$root/usr/local/bin/cargo-nextest"
    mount --bind "$nextest" "$root/usr/local/bin/cargo-nextest"
  fi
  # The project's shared data (traces the replay tests read as ../shared/data), read-only,
  # where it sits beside every checkout of the project.
  if [ -d "$shared" ]; then
    mkdir -p "$root/root/shared"
    mount --bind "$shared" "$root/root/shared"
    mount -o remount,bind,ro "$root/root/shared"
  fi
  if ((quick)); then
    timed "dependency script (deploy/build-deps.sh test)" in_root "bash deploy/build-deps.sh test"
    timed "every build script (cargo check --workspace --all-targets)" \
      in_root "cargo check --workspace --all-targets --locked --quiet"
    return
  fi
  timed "test command: $test_command" in_root "$test_command"
  # The run command in a network namespace of its own: port 8000 is ours, and every crate is in
  # CARGO_HOME since the test command built the workspace.
  timed "run command: $run_command (until a chat completion succeeds)" \
    unshare --net bash "$0" --stage=run-command
}

# In a private network namespace (loopback only): the README's run command, /v1/models, one chat.
stage_run_command() {
  ip link set lo up
  in_root "setsid $run_command >/tmp/up.log 2>&1 & echo \$! >/tmp/up.pid"
  local pid
  pid=$(cat "$root/tmp/up.pid")
  # shellcheck disable=SC2064
  trap "kill -TERM -- -$pid 2>/dev/null || true; sleep 2; kill -KILL -- -$pid 2>/dev/null || true" EXIT
  local deadline=$((SECONDS + 3600))
  until curl -sf http://127.0.0.1:8000/v1/models >/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "fresh-machine.sh: the run command exited before /v1/models answered:" >&2
      tail -n 30 "$root/tmp/up.log" >&2
      return 1
    fi
    if ((SECONDS > deadline)); then
      echo "fresh-machine.sh: /v1/models did not answer within an hour" >&2
      return 1
    fi
    sleep 2
  done
  curl -sf http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' -d @- <<'JSON' |
{"model":"sim-8b","messages":[{"role":"user","content":"Hello!"}],"max_tokens":16}
JSON
    python3 -c '
import json, sys
reply = json.load(sys.stdin)
assert reply["choices"][0]["message"]["content"], reply
print("fresh-machine: chat completion answered, usage", reply["usage"], file=sys.stderr)
'
}

case "$stage" in
  mounted) stage_mounted; exit 0 ;;
  run-command) stage_run_command; exit 0 ;;
  "") ;;
  *) echo "fresh-machine.sh: unknown stage '$stage'" >&2; exit 64 ;;
esac

if [ -n "${SWITCHYARD_FRESH_ROOT:-}" ]; then
  echo "fresh-machine.sh: already inside a fresh root; not nesting another" >&2
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "fresh-machine.sh: needs root (it mounts and chroots); run it with sudo" >&2
  exit 1
fi

# The packages a new user's machine has besides the Rust toolchain (see README.md).
BASE_PACKAGES="ca-certificates,git,curl,python3,python3-pip,gcc,libc6-dev,procps,iproute2"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/switchyard/fresh-root"

step_started=0
step_name=""
step() {
  finish_step
  step_name=$1
  step_started=$SECONDS
  echo "fresh-machine: $step_name ..." >&2
}
finish_step() {
  if [ -n "$step_name" ]; then
    echo "fresh-machine: $step_name: $((SECONDS - step_started)) s" >&2
    step_name=""
  fi
}

# ---- the root, from the cache or made now ----
step "Debian root (mmdebstrap minbase)"
# mmdebstrap builds the root; it is this check's own tool, not a build or test dependency.
if ! command -v mmdebstrap >/dev/null 2>&1; then
  echo "fresh-machine: installing mmdebstrap (apt-get)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >&2
fi
sources=()
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
  [ -s "$f" ] && grep -Eq '^(deb |URIs:)' "$f" && sources+=("$f")
done
if ((${#sources[@]} == 0)); then
  echo "fresh-machine.sh: no apt sources on this machine to build the root from" >&2
  exit 1
fi
key=$(cat "${sources[@]}" <(echo "$BASE_PACKAGES") | sha256sum | cut -c1-12)
tarball="$CACHE/bookworm-minbase-$key.tar"
if [ ! -s "$tarball" ]; then
  mkdir -p "$CACHE"
  # mmdebstrap picks the output format from the name's extension: keep .tar on the partial file.
  partial="$CACHE/partial-$key.tar"
  mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" bookworm "$partial" "${sources[@]}"
  mv "$partial" "$tarball"
fi

work=$(mktemp -d "${TMPDIR:-/var/tmp}/switchyard-fresh.XXXXXX")
root="$work/root"
cleanup() {
  local rc=$?
  finish_step
  if ((keep)); then
    echo "fresh-machine: root kept at $root" >&2
  else
    rm -rf --one-file-system "$work"
  fi
  if ((rc)); then echo "fresh-machine.sh: FAILED (exit $rc)" >&2; fi
}
trap cleanup EXIT
mkdir -p "$root"
tar -xf "$tarball" -C "$root"

# A new user's Python takes `pip install` (the machines' own CPython does); Debian's refuses it
# for its system Python (PEP 668), so the root says what the machines' Python does by default.
printf '[global]\nbreak-system-packages = true\n' >"$root/etc/pip.conf"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# A machine knows its own names (`localhost` among them); a bare root has no /etc/hosts.
cp /etc/hosts "$root/etc/hosts"
# The network's own certificate authorities (a TLS-inspecting egress proxy, say) are part of the
# machine, not of what a user installs: the root trusts what the host trusts.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null 2>&1
fi

# ---- the checkout: committed files plus the working tree's changes ----
step "copy the checkout"
mkdir -p "$root/root"
git clone --quiet --no-local --no-hardlinks "$checkout" "$root/root/switchyard"
# Changed (staged or not) and untracked files over the clone; files deleted since HEAD go.
{
  git diff -z --name-only --diff-filter=d HEAD
  git ls-files -z --others --exclude-standard
} | tar --null -T - -cf - | tar -xf - -C "$root/root/switchyard"
git diff -z --name-only --diff-filter=D HEAD | (cd "$root/root/switchyard" && xargs -0 -r rm -f)

# ---- into the root: private mounts, read-only toolchain, fresh CARGO_HOME ----
rustup_home="${RUSTUP_HOME:-$HOME/.rustup}"
cargo_bin=$(dirname "$(command -v cargo)")
nextest=$(command -v cargo-nextest || true)
readme_commands=$(awk '/^```sh/{inside=1; next} /^```/{if (inside) exit} inside && !/^#/ && NF' README.md)
if [ "$(printf '%s\n' "$readme_commands" | wc -l)" != 2 ]; then
  echo "fresh-machine.sh: README.md's first sh block should hold exactly two commands (run, test); found:" >&2
  printf '%s\n' "$readme_commands" >&2
  exit 1
fi
run_command=$(printf '%s\n' "$readme_commands" | sed -n 1p)
test_command=$(printf '%s\n' "$readme_commands" | sed -n 2p)

finish_step
shared="$(cd "$checkout/.." && pwd)/shared"
export root rustup_home cargo_bin nextest quick run_command test_command shared
stage_args=(--stage=mounted)
((quick)) && stage_args+=(--quick)
unshare --mount --propagation private bash "$0" "${stage_args[@]}"
echo "fresh-machine: passed ($SECONDS s in all)" >&2
