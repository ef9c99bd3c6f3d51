#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs checkpointd with the daemon, the
# client and the test tools; .venv-daemon with the daemon alone (no TensorFlow);
# then .venv-tools with the pinned lint and type-check
# tools (scripts/tools-requirements.txt says why they live apart). Safe to run
# again: pip skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "checkpointd needs Python 3.11 (TensorFlow 2.15); found $("$PY" --version). Set PYTHON=/path/to/python3.11." >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade "pip>=23.2"
# PYTHONWARNINGS: silence setuptools' editable-install banner, not errors.
PYTHONWARNINGS=ignore .venv/bin/python -m pip install --quiet -e ".[daemon,client,test]"
# .venv-daemon: the daemon's extra alone (no TensorFlow), editable, for the test of a
# trainer on TF 2.15 saving through a daemon whose host has none (test_daemon_without_tf).
# Editable, so the tree's code runs; reinstalled only when pyproject.toml changed.
[ -x .venv-daemon/bin/python ] || "$PY" -m venv .venv-daemon
if [ ! -x .venv-daemon/bin/checkpointd ] || [ pyproject.toml -nt .venv-daemon/.installed ]; then
  PYTHONWARNINGS=ignore .venv-daemon/bin/python -m pip install --quiet -e ".[daemon]"
  touch .venv-daemon/.installed
fi
[ -x .venv-tools/bin/python ] || "$PY" -m venv .venv-tools
.venv-tools/bin/python -m pip install --quiet --upgrade "pip>=23.2"
.venv-tools/bin/python -m pip install --quiet -r scripts/tools-requirements.txt
echo "installed into $(pwd)/.venv, $(pwd)/.venv-daemon and $(pwd)/.venv-tools"
