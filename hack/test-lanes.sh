#!/usr/bin/env bash
# `make test`'s pytest: lanes side by side, then the type checker's verdict.
#   unit+e2e     the CPU-bound tiers (trainer gangs on the host), in the suite's order;
#   integration  the cluster tier, which mostly waits (pods starting, control loops, the background build of
#                the cluster's parts), itself in lanes against the one cluster (tests/support/lanes.py):
#                integration/one beside integration/two, each with its own namespaces and operators (lane two
#                taking over lane one's tests not begun when its own are done), then
#                integration/whole (the tests that change the cluster for everyone) alone.
# The integration lanes are the long pole and wait on pods; the unit+e2e lane has minutes to spare. So the
# unit+e2e lane runs in a cpu cgroup of its own that weighs as much as LANE_CPU_SHARES/1024 busy processes
# (2 by default), not one per process: under contention the pods and the control plane get their share
# first, and the lane takes every cycle they leave. Not lower: at nice 10 (a tenth of a process each) the
# lane's tests that bound a wait (a signal forwarded, a report retried) met loads they were not written for.
# KUBETRAIN_LANE_CPU_SHARES=0, or a machine where this script cannot make the cgroup: one process, one share.
# Each lane's lines carry its name (whole lines, so the two never cut into each other); each ends with its own
# summary and slowest durations. mypy runs beside both. The exit status is the first failure's, else 0.
# Usage: hack/test-lanes.sh [pytest args...]
# One lane, the tiers one after another, with KUBETRAIN_TEST_LANES=1 or when the arguments name tests/ paths.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
BIN=${BIN:-.venv/bin}
NICENESS=0
LANE_CGROUP=kubetrain-test-lane  # the unit+e2e lane's cpu cgroup, under v1's cpu hierarchy or v2's root

lane() {  # lane NAME NICENESS TESTS... -- ARGS...: pytest on TESTS, each line prefixed with NAME
  local name=$1 niceness=$2; shift 2
  local tests=() procs=""
  while [[ $1 != -- ]]; do tests+=("$1"); shift; done
  shift
  [[ $name != unit+e2e ]] || procs=$(lane_cgroup)
  # The cgroup is joined by the shell that then becomes pytest, so the lane's every process starts in it.
  nice -n "$niceness" bash -c '[[ -z $1 ]] || echo $$ > "$1"; shift; exec "$@"' _ "$procs" \
    "$BIN/python" -m pytest "${tests[@]}" "$@" 2>&1 | sed -u "s#^#${name}| #" | tee -a "$lanes_log"
  return "${PIPESTATUS[0]}"
}

lane_cgroup() {  # the cgroup.procs file of the unit+e2e lane's cpu cgroup (made here), or nothing
  local shares=${KUBETRAIN_LANE_CPU_SHARES:-2048} dir
  (( shares > 0 )) && [[ -w /sys/fs/cgroup ]] || return 0
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then  # v2: cpu.weight 100 is v1's 1024 shares
    grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || return 0
    dir=/sys/fs/cgroup/$LANE_CGROUP
    mkdir -p "$dir" && echo $(( (shares * 100 + 1023) / 1024 )) > "$dir/cpu.weight" || return 0
  else
    dir=/sys/fs/cgroup/cpu/$LANE_CGROUP
    mkdir -p "$dir" 2>/dev/null && echo "$shares" > "$dir/cpu.shares" || return 0
  fi
  echo "$dir/cgroup.procs"
}

verdict() {  # verdict STATUS...: the first failure's status; 5 (pytest: no test selected) only when all are 5
  local s first=0 all_none=1
  for s in "$@"; do
    (( s == 5 )) || all_none=0
    (( first != 0 || s == 0 || s == 5 )) || first=$s
  done
  (( all_none )) && echo 5 || echo "$first"
}

cluster_running() {
  PYTHONPATH=tests "$BIN/python" -c 'import sys; from support.cluster import cluster_running as up; sys.exit(not up())' \
    2>/dev/null
}

integration_lanes() {  # the integration tier's lanes; the cluster stopped after the last unless it ran before
  local was_up=0 one two whole
  cluster_running && was_up=1
  # Lane two takes over lane one's tests that lane one has not begun once its own are done: claimed here.
  KUBETRAIN_TEST_CLAIMS=$claims KUBETRAIN_TEST_LANE=one lane integration/one "$NICENESS" tests/integration -- "$@" &
  local one_pid=$!
  KUBETRAIN_TEST_CLAIMS=$claims KUBETRAIN_TEST_LANE=two lane integration/two "$NICENESS" tests/integration -- "$@"
  two=$?
  wait "$one_pid"; one=$?
  KUBETRAIN_TEST_LANE=whole lane integration/whole "$NICENESS" tests/integration -- "$@"; whole=$?
  if (( ! was_up )) && [[ ${KUBETRAIN_KEEP_CLUSTER:-} != 1 ]]; then
    bash hack/cluster-down.sh 2>&1 | sed -u "s/^/integration| /"
  fi
  echo "integration lanes: one exit ${one}, two exit ${two}, whole exit ${whole}" | tee -a "$lanes_log"
  return "$(verdict "$one" "$two" "$whole")"
}

mypy_log=$(mktemp)
lanes_log=$(mktemp)
claims=$(mktemp -d)
trap 'rm -rf "$mypy_log" "$lanes_log" "$claims"; rmdir "/sys/fs/cgroup/cpu/$LANE_CGROUP" "/sys/fs/cgroup/$LANE_CGROUP" 2>/dev/null' EXIT
"$BIN/mypy" core/src operator/src trainer-image/src >"$mypy_log" 2>&1 &
mypy_pid=$!

if [[ ${KUBETRAIN_TEST_LANES:-2} == 1 || " $* " == *" tests/"* ]]; then
  "$BIN/python" -m pytest "$@"; status=$?
else
  integration_lanes "$@" &
  integration_pid=$!
  lane unit+e2e "$NICENESS" tests/unit tests/e2e -- "$@"; first=$?
  wait "$integration_pid"; second=$?
  echo "test lanes: unit+e2e exit ${first}, integration exit ${second}"
  # A CI page often shows only the end of the log: repeat each lane's failures there.
  grep -E '^[^|]+\| (FAILED|ERROR) ' "$lanes_log" | sed 's/^/failed in lane /' || true
  # 5 is pytest's "no tests selected": fine for a lane (a -k that picks tests of one tier), not for all
  status=$(verdict "$first" "$second")
fi

wait "$mypy_pid"; mypy=$?
echo "mypy (beside the tests):"
cat "$mypy_log"
exit $(( status ? status : mypy ))
