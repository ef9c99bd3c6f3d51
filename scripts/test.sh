#!/usr/bin/env bash
# Installs everything, runs the lint and type checks, then the whole test suite
# (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh

# Lint, format and types: all three run, so one pass shows every complaint;
# any of them failing fails the script before pytest. The tools are the pinned
# ones in .venv-tools; mypy reads .venv's packages (scripts/tools-requirements.txt).
checks=0
check() { echo "+ $*"; "$@" || checks=1; }
check .venv-tools/bin/ruff check
check .venv-tools/bin/ruff format --check
check .venv-tools/bin/mypy --python-executable .venv/bin/python
if [ "$checks" -ne 0 ]; then
  echo "lint or type check failed (above); the tests did not run" >&2
  exit 1
fi

# tests/integration/ops/test_prometheus.py runs promtool and a real Prometheus.
# Debian's package ships both; its maintainer script would start a service, so
# a policy-rc.d that denies starts is in place during the install (unless the
# machine has one already): the tests start their own prometheus.
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  if [ "$(id -u)" -eq 0 ]; then
    policy=/usr/sbin/policy-rc.d
    if [ ! -e "$policy" ]; then
      printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
      trap 'rm -f "$policy"' EXIT
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    if [ -n "$(trap -p EXIT)" ]; then rm -f "$policy"; trap - EXIT; fi
  else
    echo "warning: prometheus/promtool missing and not root; the Prometheus tests will be skipped" >&2
  fi
fi

# tests/integration/s3/test_s3.py runs against a real S3 server, Ceph's radosgw on
# loopback: its session fixture (tests/integration/support/rgw.py) runs scripts/rgw.sh,
# which installs Debian's ceph-mon, ceph-osd, radosgw and ceph-common when they
# are missing (as root, ~30 s the first time), starts it (~3-4 s) and stops it at
# the end. If Ceph cannot be installed (not root, apt unreachable) those tests
# skip; -rs prints every skip's reason in the summary, so that is never silent.
# Installed here, once, so the test workers below never race each other on apt;
# exit 3 (cannot install) leaves the S3 tests to skip with the reason.
scripts/rgw.sh install || [ $? -eq 3 ]
export TF_CPP_MIN_LOG_LEVEL=2
# Two workers (pytest-xdist), each taking whole test files: most tests wait on
# daemons, TensorFlow and fsyncs, so two keep both cores of CI's machine busy.
# Every test picks its own ports and dirs, and each worker starts its own
# radosgw and Prometheus when its tests ask. CHECKPOINTD_TEST_WORKERS=0 runs
# them in this one process. --durations: the slowest tests in every log, to keep
# the suite within its time.
workers=${CHECKPOINTD_TEST_WORKERS:-2}
exec .venv/bin/python -m pytest tests -q -rs --durations=15 -p no:cacheprovider -n "$workers" --dist loadfile "$@"
