#!/usr/bin/env bash
# Create .venv (once) and install the pinned requirements into it. Sourced by start.sh and test.sh, or by hand
# (`source scripts/venv.sh`): it leaves the caller's shell options alone (no set -e here: in an interactive shell
# the next failing command would close the terminal) and returns non-zero on failure; scripts that want strict
# mode set it themselves. WORKBENCH_VENV picks another venv folder.
_wb_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
_wb_venv="${WORKBENCH_VENV:-$_wb_root/.venv}"
if [ ! -x "$_wb_venv/bin/python" ]; then
  python3 -m venv "$_wb_venv" || { echo "venv.sh: cannot create $_wb_venv" >&2; return 1; }
fi
_wb_want="$(sha256sum "$_wb_root/requirements.txt" | cut -d' ' -f1)" || return 1
if [ "$(cat "$_wb_venv/.requirements.sha" 2>/dev/null)" != "$_wb_want" ]; then
  { "$_wb_venv/bin/python" -m pip install -q --upgrade pip &&
    "$_wb_venv/bin/python" -m pip install -q -r "$_wb_root/requirements.txt"; } ||
    { echo "venv.sh: installing requirements.txt into $_wb_venv failed" >&2; return 1; }
  echo "$_wb_want" > "$_wb_venv/.requirements.sha"
fi
export PATH="$_wb_venv/bin:$PATH"
export PYTHONPATH="$_wb_root${PYTHONPATH:+:$PYTHONPATH}"
unset _wb_root _wb_venv _wb_want
