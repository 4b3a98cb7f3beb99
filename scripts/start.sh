#!/usr/bin/env bash
# The main command: builds .venv with the pinned requirements if needed, then starts the dashboard on the built-in
# tiny models (http://localhost:8501). Extra arguments go to `streamlit run`, e.g. --server.port 8600.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
exec streamlit run app.py --server.fileWatcherType none --server.headless true \
  --browser.gatherUsageStats false "$@"
