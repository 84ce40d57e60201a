#!/usr/bin/env bash
# Builds the libFuzzer drivers and fuzzes each target for a bounded time.
#
#   fuzz/run.sh [--time SECONDS] [--build-only] [TARGET...]
#
#   --time S      seconds of fuzzing per target (default 30)
#   --build-only  build the drivers and stop
#   TARGET        http_chat_body, zmq_event, trtllm_events, proto_conversions, chat_template
#                 (default: all)
#
# Stable Rust, no cargo-fuzz: libfuzzer-sys (libFuzzer's C++ sources, built by its build script
# with the system C++ compiler) and the SanitizerCoverage passes rustc runs on request, as
# cargo-fuzz sets them up minus AddressSanitizer (nightly only; Switchyard forbids unsafe code).
# The build goes to $SWITCHYARD_FUZZ_TARGET_DIR (default fuzz/target), kept apart from the
# main target directory because every crate is compiled with the coverage passes.
#
# Each target runs from the committed seeds (fuzz/corpus/<target>) and crashes
# (fuzz/regressions/<target>); inputs that reach new coverage are kept in the working corpus
# fuzz/work/<target> (not committed; reused by the next run). A crash stops the run with exit 1
# and names the input under fuzz/work/artifacts/<target>/: fix the bug, then copy the input to
# fuzz/regressions/<target>/ so the replay test (cargo nextest run -p switchyard-fuzz) keeps it
# fixed. A summary line per target gives executions, executions/s, coverage and the result.
set -euo pipefail
cd "$(dirname "$0")"

seconds=30
build_only=0
targets=()
all=(http_chat_body zmq_event trtllm_events proto_conversions chat_template)
while (($#)); do
  case "$1" in
    --time)
      seconds=${2:?--time needs a number of seconds}
      shift
      ;;
    --time=*) seconds=${1#--time=} ;;
    --build-only) build_only=1 ;;
    -h | --help)
      sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "fuzz/run.sh: unknown option '$1'" >&2
      exit 64
      ;;
    *)
      if [[ ! " ${all[*]} " == *" $1 "* ]]; then
        echo "fuzz/run.sh: unknown target '$1' (expected one of: ${all[*]})" >&2
        exit 64
      fi
      targets+=("$1")
      ;;
  esac
  shift
done
((${#targets[@]})) || targets=("${all[@]}")
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "fuzz/run.sh: --time must be a whole number of seconds, at least 1" >&2
  exit 64
fi

if ! printf '#include <vector>\nint main() { std::vector<int> v; return (int) v.size(); }\n' |
  "${CXX:-c++}" -x c++ - -o /dev/null >/dev/null 2>&1; then
  echo "fuzz/run.sh: no working C++ compiler (${CXX:-c++}); libFuzzer needs one: run deploy/build-deps.sh fuzz (Debian package g++)" >&2
  exit 1
fi

host=$(rustc -vV | sed -n 's/^host: //p')
target_dir=${SWITCHYARD_FUZZ_TARGET_DIR:-$PWD/target}
# --target keeps the flags off build scripts and proc macros, which must not be instrumented.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
started=$SECONDS
cargo build --locked --profile fuzz --target "$host" --target-dir "$target_dir" \
  $(printf -- '--bin %s ' "${targets[@]}")
echo "fuzz: build: $((SECONDS - started)) s" >&2
((build_only)) && exit 0

# The last value a sed expression prints from a log, or nothing.
last_of() {
  sed -n "$1" "$2" | tail -n 1
}

bin_dir="$target_dir/$host/fuzz"
status=0
for t in "${targets[@]}"; do
  mkdir -p "work/$t" "work/artifacts/$t" "regressions/$t"
  log="work/$t.log"
  touch "$log.start"
  set +e
  # -timeout: one input taking longer is a hang, reported like a crash; -rss_limit_mb: so is
  # memory past 2 GB. The working corpus comes first: new inputs are written there.
  "$bin_dir/$t" "work/$t" "corpus/$t" "regressions/$t" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=16384 \
    -artifact_prefix="work/artifacts/$t/" -print_final_stats=1 >"$log" 2>&1
  rc=$?
  set -e
  runs=$(last_of 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(last_of 's/^stat::average_exec_per_sec: *//p' "$log")
  cov=$(last_of 's/.* cov: \([0-9]*\).*/\1/p' "$log")
  ft=$(last_of 's/.* ft: \([0-9]*\).*/\1/p' "$log")
  corpus=$(find "work/$t" -type f | wc -l)
  if ((rc == 0)); then
    result=ok
  else
    artifact=$(find "work/artifacts/$t" -type f -newer "$log.start" | head -1)
    result="CRASH (exit $rc): fuzz/${artifact:-work/$t.log}"
    status=1
    tail -40 "$log" >&2
  fi
  printf 'fuzz: %-18s %ss  runs %s  exec/s %s  cov %s  ft %s  corpus %s  %s\n' \
    "$t" "$seconds" "${runs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "$corpus" "$result"
done
exit $status
