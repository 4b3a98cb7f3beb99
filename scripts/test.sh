#!/usr/bin/env bash
# The test command: builds .venv with the pinned requirements (CPU torch where no GPU), then runs the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
exec python -m pytest -q tests "$@"
