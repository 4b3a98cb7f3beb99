#!/usr/bin/env bash
# The main command: builds .venv with the pinned requirements if needed, then starts the dashboard on the built-in
# tiny models at http://localhost:8501. Extra arguments go to `streamlit run`, e.g. --server.port 8600.
#
# It listens on 127.0.0.1 only: whoever reaches the port can run benchmarks and studies on any path this user can
# read. To expose it on purpose: WORKBENCH_LISTEN=0.0.0.0 bash scripts/start.sh (or pass --server.address ADDR).
# WORKBENCH_DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
address=(--server.address "${WORKBENCH_LISTEN:-127.0.0.1}")
for arg in "$@"; do
  case "$arg" in --server.address|--server.address=*) address=() ;; esac  # the caller's address wins
done
cmd=(streamlit run app.py --server.fileWatcherType none --server.headless true --browser.gatherUsageStats false
     "${address[@]}" "$@")
if [ -n "${WORKBENCH_DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
case "${address[1]:-passed}" in
  127.0.0.1|localhost|::1|passed) ;;
  *) echo "start.sh: the dashboard listens on ${address[1]}: anyone who can reach the port can run benchmarks and" \
          "studies on paths this user can read" >&2 ;;
esac
exec "${cmd[@]}"
