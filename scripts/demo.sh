#!/usr/bin/env bash
# The main job: a TF-Agents DQN trainer on CartPole that saves its whole state
# through checkpointd, is preempted part way with SIGTERM (it saves the step it
# reached and exits) and resumed from the daemon by a new process at that step;
# then a second trainer that saves after every step (continuous saves) is
# SIGKILLed and resumed, and the demo prints the steps and seconds of training
# that lost (scripts/demo.py says what it prints).
#
#   scripts/demo.sh            # one daemon on ./demo/checkpoints; no root needed
#   scripts/demo.sh --fleet    # three daemons on a local S3 server (radosgw); needs root for Ceph
#
# Installs first (scripts/install.sh; CHECKPOINTD_DEMO_NO_INSTALL=1 skips it).
# Other arguments go to scripts/demo.py (--steps, --save-every, --kill-at, ...).
# Ctrl-C stops everything the demo started: the trap hands the signal to the
# demo, whose children run in sessions of their own, and waits for its cleanup.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${CHECKPOINTD_DEMO_NO_INSTALL:-}" ] || scripts/install.sh
.venv/bin/python scripts/demo.py "$@" &
demo=$!
trap 'kill -INT "$demo" 2>/dev/null || true' INT TERM HUP
code=0
wait "$demo" || code=$?
# A trapped signal ends wait early (status > 128) while the demo cleans up: wait again.
while kill -0 "$demo" 2>/dev/null; do
  code=0
  wait "$demo" || code=$?
done
exit "$code"
