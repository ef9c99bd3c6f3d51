#!/usr/bin/env bash
# The main job: installs, starts checkpointd on ./demo/checkpoints, trains a
# TF-Agents DQN on CartPole that saves through it, then loads and runs the
# newest SavedModel. Extra arguments go to scripts/demo.py (--steps, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python scripts/demo.py "$@"
