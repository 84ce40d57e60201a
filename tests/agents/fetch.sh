#!/usr/bin/env bash
# Installs the agent CLIs the end-to-end tests run unmodified (tests/agent_clients_e2e.rs):
# Claude Code and Codex CLI at the versions pinned in tests/agents/package.json, from the npm
# registry, each package checked against the integrity hash in package-lock.json (`npm ci`).
# Cached: a second run with the same lock file installs nothing.
#
#   tests/agents/fetch.sh        installs into $SWITCHYARD_AGENT_CLIENTS
#                                (default ~/.cache/switchyard/agent-clients)
#
# The tests find the clients there and name this script when they are missing. To try a client
# upgrade, change its version in package.json, run `npm install --package-lock-only` in this
# folder, capture what the new version sends (docs/openai-api.md, "Agent clients") and run the
# tests.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${SWITCHYARD_AGENT_CLIENTS:-$HOME/.cache/switchyard/agent-clients}"
mkdir -p "$dir"
stamp="$dir/.lock-sha256"
want="$(sha256sum "$here/package-lock.json" | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
  [ -x "$dir/node_modules/.bin/claude" ] && [ -x "$dir/node_modules/.bin/codex" ]; then
  echo "agent clients: cached in $dir"
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "agent clients: npm is missing (deploy/build-deps.sh test installs it)" >&2
  exit 1
fi
cp "$here/package.json" "$here/package-lock.json" "$dir/"
echo "agent clients: installing $(grep -o '"@[^"]*": "[0-9.]*"' "$here/package.json" | tr -d '"' | tr '\n' ' ')into $dir" >&2
(cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
"$dir/node_modules/.bin/claude" --version >/dev/null
"$dir/node_modules/.bin/codex" --version >/dev/null
echo "$want" >"$stamp"
echo "agent clients: installed in $dir"
