#!/usr/bin/env bash
# Installs everything and runs the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
export TF_CPP_MIN_LOG_LEVEL=2
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
