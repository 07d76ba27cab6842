#!/usr/bin/env bash
# `make test`'s pytest: lanes side by side, then the type checker's verdict.
#   unit+e2e     the CPU-bound tiers (trainer gangs on the host), in the suite's order;
#   integration  the cluster tier, which mostly waits (pods starting, control loops, the background build of
#                the cluster's parts), itself in lanes against the one cluster (tests/support/lanes.py):
#                integration/one beside integration/two, each with its own namespaces and operators (lane two
#                taking over lane one's tests not begun when its own are done), then
#                integration/whole (the tests that change the cluster for everyone) alone. All at the same priority: with the unit+e2e lane at nice 10 its tests
#                that bound a wait (a signal forwarded, a report retried) met loads they were not written for.
# Each lane's lines carry its name (whole lines, so the two never cut into each other); each ends with its own
# summary and slowest durations. mypy runs beside both. The exit status is the first failure's, else 0.
# Usage: hack/test-lanes.sh [pytest args...]
# One lane, the tiers one after another, with KUBETRAIN_TEST_LANES=1 or when the arguments name tests/ paths.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
BIN=${BIN:-.venv/bin}
NICENESS=0

lane() {  # lane NAME NICENESS TESTS... -- ARGS...: pytest on TESTS, each line prefixed with NAME
  local name=$1 niceness=$2; shift 2
  local tests=()
  while [[ $1 != -- ]]; do tests+=("$1"); shift; done
  shift
  nice -n "$niceness" "$BIN/python" -m pytest "${tests[@]}" "$@" 2>&1 | sed -u "s#^#${name}| #" | tee -a "$lanes_log"
  return "${PIPESTATUS[0]}"
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
trap 'rm -rf "$mypy_log" "$lanes_log" "$claims"' EXIT
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
