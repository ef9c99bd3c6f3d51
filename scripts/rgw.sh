#!/usr/bin/env bash
# A single-node Ceph radosgw on loopback: the real S3 server of the tests.
#
#   scripts/rgw.sh start DIR [MON_PORT [RGW_PORT]]   # installs Ceph if missing (root), starts, prints env lines
#   scripts/rgw.sh install                           # installs Ceph if missing (root), starts nothing
#   scripts/rgw.sh env DIR                           # prints the env lines of a started one
#   scripts/rgw.sh stop DIR                          # stops radosgw, then the OSD, then the mon, by PID
#   scripts/rgw.sh stop-gw DIR / start-gw DIR        # kills / restarts the gateway alone (fault tests)
#   RGW_BIND=10.231.0.1 scripts/rgw.sh start DIR     # the gateway on that address instead of 127.0.0.1
#
# mon + memstore OSD + radosgw, auth none, no ceph-mgr. The env lines (stdout,
# also in DIR/env) are AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
# AWS_DEFAULT_REGION and AWS_ENDPOINT_URL (what checkpointd and boto3 read:
# `set -a; . DIR/env; set +a` and checkpointd uses this server), then
# CHECKPOINTD_TEST_S3_ENDPOINT and CHECKPOINTD_TEST_S3_BUCKET (what the tests
# parse); the keys are fixed test keys. `start` also says on stderr what to
# pass checkpointd (--s3-endpoint-url URL, or AWS_ENDPOINT_URL=URL). The gateway listens on 127.0.0.1 only, or on the one
# address RGW_BIND names (an address of this machine, e.g. a bridge that
# network namespaces reach: the fleet tests); the mon and OSD stay on loopback.
# Exit codes: 0 started, 3 Ceph cannot be installed (not root, or apt
# unreachable), 1 anything else (the last lines of the logs are printed).
set -euo pipefail

ACCESS_KEY=checkpointdtestaccess
SECRET_KEY=checkpointdtestsecret0123456789abcdefghij
BUCKET=checkpointd-test
PACKAGES=(ceph-mon ceph-osd radosgw ceph-common)

die() { echo "rgw.sh: $*" >&2; exit 1; }

# The repo's venv has boto3 (for the bucket); any python3 does for the rest.
PY=${CHECKPOINTD_PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
[ -x "$PY" ] || PY=python3

BIND=${RGW_BIND:-127.0.0.1}  # the gateway's address (start); start-gw and env read it back from DIR

port_busy() {  # port_busy PORT [HOST]
  # Anything listening there (the ceph CLI would silently join another cluster).
  (exec 3<>"/dev/tcp/${2:-127.0.0.1}/$1") 2>/dev/null
}

free_port() {  # free_port [HOST]
  "$PY" -c 'import socket, sys; s=socket.socket(); s.bind((sys.argv[1],0)); print(s.getsockname()[1])' "${1:-127.0.0.1}"
}

bind_of() {  # the gateway address a started one in DIR was given
  if [ -f "$1/rgw.bind" ]; then cat "$1/rgw.bind"; else echo 127.0.0.1; fi
}

install_ceph() {
  command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v radosgw >/dev/null \
    && command -v radosgw-admin >/dev/null && command -v monmaptool >/dev/null && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "rgw.sh: Ceph (${PACKAGES[*]}) is not installed and this is not root" >&2
    exit 3
  fi
  export DEBIAN_FRONTEND=noninteractive
  # A policy-rc.d that denies starts: the packages' scripts must not start services.
  local policy=/usr/sbin/policy-rc.d made=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made=1; fi
  local ok=0
  if apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1; then
    ok=1
  elif apt-get update -qq >/dev/null 2>&1 \
    && apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1; then
    ok=1
  fi
  [ "$made" -eq 1 ] && rm -f "$policy"
  if [ "$ok" -ne 1 ]; then
    echo "rgw.sh: apt-get could not install ${PACKAGES[*]} (apt unreachable?)" >&2
    exit 3
  fi
}

print_env() {
  local dir=$1
  [ -f "$dir/rgw.port" ] || die "no radosgw started in $dir"
  echo "AWS_ACCESS_KEY_ID=$ACCESS_KEY"
  echo "AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
  echo "AWS_DEFAULT_REGION=us-east-1"
  echo "AWS_ENDPOINT_URL=http://$(bind_of "$dir"):$(cat "$dir/rgw.port")"
  echo "CHECKPOINTD_TEST_S3_ENDPOINT=http://$(bind_of "$dir"):$(cat "$dir/rgw.port")"
  echo "CHECKPOINTD_TEST_S3_BUCKET=$BUCKET"
}

show_logs() {
  local dir=$1
  for f in "$dir"/log/*.log; do
    [ -f "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }
  done
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "rgw.sh: timed out waiting for $what" >&2; return 1; }
    sleep 0.1
  done
}

start() {
  local dir=$1 mon_port=${2:-} rgw_port=${3:-}
  install_ceph
  [ -n "$mon_port" ] || mon_port=$(free_port)
  [ -n "$rgw_port" ] || rgw_port=$(free_port "$BIND") || die "cannot bind RGW_BIND=$BIND (not an address of this machine?)"
  port_busy "$mon_port" && die "port $mon_port (mon) is in use; refusing to join another cluster"
  port_busy "$rgw_port" "$BIND" && die "port $rgw_port (radosgw) is in use"
  mkdir -p "$dir"/{mon,osd,log,run,rgw}
  dir=$(cd "$dir" && pwd)
  local fsid conf=$dir/ceph.conf
  fsid=$(cat /proc/sys/kernel/random/uuid 2>/dev/null || "$PY" -c 'import uuid; print(uuid.uuid4())')
  # The memstore OSD holds every stored byte in RAM, taking only what is stored, and refuses writes
  # (clients wait) once 95 % full. Deleted objects stay stored until radosgw's garbage collection
  # (every 10 s, objects deleted 5 s before): the bench's large S3 section writes and deletes about
  # 1.6 GB a round, a round every ~5 s, so the store must hold a few rounds at once.
  cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$mon_port
auth cluster required = none
auth service required = none
auth client required = none
keyring = /dev/null
run dir = $dir/run
log file = $dir/log/\$name.log
admin socket = $dir/run/\$name.asok
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool delete = true
mon allow pool size one = true
mon warn on pool no redundancy = false
paxos propose interval = 0.05
paxos min wait = 0.01
[mon.a]
mon data = $dir/mon
[osd.0]
osd data = $dir/osd
osd objectstore = memstore
memstore device bytes = 8589934592
osd fast shutdown = false
[client.rgw.a]
ms mon client mode = crc
rgw frontends = beast endpoint=$BIND:$rgw_port
rgw data = $dir/rgw
rgw gc obj min wait = 5
rgw gc processor period = 10
rgw gc processor max time = 10
rgw enable usage log = false
EOF
  local C=(-c "$conf")
  monmaptool --create --clobber --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$dir/monmap" >/dev/null
  ceph-mon "${C[@]}" --mkfs -i a --monmap "$dir/monmap" --keyring /dev/null
  setsid ceph-mon "${C[@]}" -i a -f >"$dir/log/mon.stdout" 2>&1 &
  echo $! >"$dir/mon.pid"
  # A mon of another cluster would answer with another fsid.
  if ! wait_for 30 "the mon" timeout 5 ceph "${C[@]}" fsid; then show_logs "$dir"; exit 1; fi
  local got
  got=$(timeout 5 ceph "${C[@]}" fsid)
  [ "$got" = "$fsid" ] || die "the mon on port $mon_port has fsid $got, not ours ($fsid)"
  local id
  id=$(timeout 10 ceph "${C[@]}" osd create)
  timeout 10 ceph "${C[@]}" osd crush add "osd.$id" 1.0 host=localhost root=default >/dev/null 2>&1 \
    || timeout 10 ceph "${C[@]}" osd crush add-bucket localhost host >/dev/null
  timeout 10 ceph "${C[@]}" osd crush move localhost root=default >/dev/null 2>&1 || true
  timeout 10 ceph "${C[@]}" osd crush add "osd.$id" 1.0 host=localhost >/dev/null 2>&1 || true
  ceph-osd "${C[@]}" -i "$id" --mkjournal --mkfs --keyring /dev/null >/dev/null 2>&1 \
    || { show_logs "$dir"; die "ceph-osd --mkfs failed"; }
  setsid ceph-osd "${C[@]}" -i "$id" -f >"$dir/log/osd.stdout" 2>&1 &
  echo $! >"$dir/osd.pid"
  if ! wait_for 30 "the OSD to be up" sh -c "ceph ${C[*]} osd stat -f json | grep -q '\"num_up_osds\":1'"; then
    show_logs "$dir"; exit 1
  fi
  setsid radosgw "${C[@]}" -n client.rgw.a -f >"$dir/log/rgw.stdout" 2>&1 &
  echo $! >"$dir/rgw.pid"
  echo "$rgw_port" >"$dir/rgw.port"
  echo "$mon_port" >"$dir/mon.port"
  echo "$BIND" >"$dir/rgw.bind"
  if ! wait_for 60 "radosgw to answer" port_busy "$rgw_port" "$BIND"; then
    show_logs "$dir"; exit 1
  fi
  radosgw-admin "${C[@]}" user create --uid=checkpointd-test --display-name=checkpointd-test \
    --access-key="$ACCESS_KEY" --secret="$SECRET_KEY" >/dev/null
  print_env "$dir" >"$dir/env"
  # The bucket, through the S3 API (radosgw-admin cannot create one).
  (set -a; . "$dir/env"; "$PY" - <<'PY') || { show_logs "$dir"; die "could not create the bucket (boto3 in $PY?)"; }
import os, boto3
s3 = boto3.client("s3", endpoint_url=os.environ["CHECKPOINTD_TEST_S3_ENDPOINT"])
s3.create_bucket(Bucket=os.environ["CHECKPOINTD_TEST_S3_BUCKET"])
PY
  cat "$dir/env"
  local url
  url="http://$(bind_of "$dir"):$rgw_port"
  cat >&2 <<EOF
rgw.sh: radosgw is serving S3 at $url (bucket $BUCKET made; the keys are test keys).
  For checkpointd and boto3 in this shell:  set -a; . $dir/env; set +a
  Or pass the server to checkpointd:        --s3-endpoint-url $url  (credentials: the AWS_* lines above)
  Stop it:                                  $0 stop $dir
EOF
}

stop() {
  local dir=$1 name pid
  for name in rgw osd mon; do  # the gateway, then the OSD (flushes memstore), then the mon
    [ -f "$dir/$name.pid" ] || continue
    pid=$(cat "$dir/$name.pid")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$dir/$name.pid"
  done
}

# The gateway alone, for tests of the S3 server going away and coming back
# (the mon and the OSD keep the data meanwhile).
stop_gw() {
  local dir=$1 pid
  [ -f "$dir/rgw.pid" ] || return 0
  pid=$(cat "$dir/rgw.pid")
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  rm -f "$dir/rgw.pid"
}

start_gw() {
  local dir=$1 port bind
  port=$(cat "$dir/rgw.port")
  bind=$(bind_of "$dir")
  port_busy "$port" "$bind" && die "port $port (radosgw) is in use"
  setsid radosgw -c "$dir/ceph.conf" -n client.rgw.a -f >>"$dir/log/rgw.stdout" 2>&1 &
  echo $! >"$dir/rgw.pid"
  wait_for 60 "radosgw to answer" port_busy "$port" "$bind" || { show_logs "$dir"; exit 1; }
}

cmd=${1:-}
if [ "$cmd" = install ]; then install_ceph; exit 0; fi
[ $# -ge 2 ] || { echo "usage: $0 install | start|stop|env DIR [MON_PORT [RGW_PORT]]" >&2; exit 2; }
case "$cmd" in
  start) start "$2" "${3:-}" "${4:-}" ;;
  env) print_env "$2" ;;
  stop) stop "$2" ;;
  stop-gw) stop_gw "$2" ;;
  start-gw) start_gw "$2" ;;
  *) echo "usage: $0 start|stop|env DIR [MON_PORT [RGW_PORT]]" >&2; exit 2 ;;
esac
