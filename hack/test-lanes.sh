#!/usr/bin/env bash
# `make test`'s pytest: two lanes side by side, then the type checker's verdict.
#   unit+e2e     the CPU-bound tiers (trainer gangs on the host), in the suite's order;
#   integration  the cluster tier, which mostly waits (pods starting, control loops, the background build of
#                the cluster's parts). Both at the same priority: with the unit+e2e lane at nice 10 its tests
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
  nice -n "$niceness" "$BIN/python" -m pytest "${tests[@]}" "$@" 2>&1 | sed -u "s/^/${name}| /" | tee -a "$lanes_log"
  return "${PIPESTATUS[0]}"
}

mypy_log=$(mktemp)
lanes_log=$(mktemp)
trap 'rm -f "$mypy_log" "$lanes_log"' EXIT
"$BIN/mypy" core/src operator/src trainer-image/src >"$mypy_log" 2>&1 &
mypy_pid=$!

if [[ ${KUBETRAIN_TEST_LANES:-2} == 1 || " $* " == *" tests/"* ]]; then
  "$BIN/python" -m pytest "$@"; status=$?
else
  lane integration "$NICENESS" tests/integration -- "$@" &
  integration_pid=$!
  lane unit+e2e "$NICENESS" tests/unit tests/e2e -- "$@"; first=$?
  wait "$integration_pid"; second=$?
  echo "test lanes: unit+e2e exit ${first}, integration exit ${second}"
  # A CI page often shows only the end of the log: repeat each lane's failures there.
  grep -E '^[^|]+\| (FAILED|ERROR) ' "$lanes_log" | sed 's/^/failed in lane /' || true
  # 5 is pytest's "no tests selected": fine for one lane (a -k that picks tests of one tier), not for both
  if (( first == 5 && second != 5 )); then first=0; fi
  if (( second == 5 && first != 5 )); then second=0; fi
  status=$(( first ? first : second ))
fi

wait "$mypy_pid"; mypy=$?
echo "mypy (beside the tests):"
cat "$mypy_log"
exit $(( status ? status : mypy ))
