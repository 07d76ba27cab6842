#!/usr/bin/env bash
# Build everything the test suite needs, once, up front, in the background: the Go binaries of the test
# cluster and of the tools the tests run (helm, Kueue), the object store's jar (S3Proxy), and the operator and trainer images
# where this machine can build them. .ci/run and `make test` start it first thing; the tests, `make
# cluster-up` and `make images` then find each part built, or wait for the one they need, saying so.
#
#   hack/prebuild.sh start     start it in the background (a no-op while one runs); prints its log's path
#   hack/prebuild.sh run       the same in the foreground
#   hack/prebuild.sh status    what is built (with its time), what is building (for how long), what is left
#   hack/prebuild.sh wait      until it has finished, with its status every 30 s
#
# Two lanes run side by side: the Go builds, one after the other in PREBUILD_ORDER (hack/lib.sh: what
# stands on `make test`'s longest path first; they share one GOCACHE and GOMODCACHE), and the images (I/O and
# the network more than CPU): hack/node-deps.sh under CI=true, then hack/images.sh operator, trainer.
# KUBETRAIN_PREBUILD_IMAGES: auto (default: under CI=true, or where `hack/images.sh check` passes), 1, 0.
# State in ${KUBETRAIN_CACHE}/prebuild/: prebuild.log (every build's output), status (one line per
# event: "<epoch> <part> <plan|start|done|present|fail|end> [seconds | lane parts...]"), progress (a
# line per part started and finished, with what is left: the test log shows each, tests/support/builds.py),
# pid, run.lock (held while it runs).
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

P="${KUBETRAIN_CACHE}/prebuild"
STATUS="${P}/status"
LOGF="${P}/prebuild.log"
IMAGE_PARTS=(image-operator image-trainer)

PROGRESS="${P}/progress"
event() { echo "$(date +%s) $*" >>"$STATUS"; }
# progress <text>: a line for people (the test log shows each new one, tests/support/builds.py), with what is left.
progress() {
  local line
  line="[$(date +%H:%M:%S)] prebuild: $*"
  log "prebuild: $*"
  echo "${line}; $(summary --line)" >>"$PROGRESS"
}

running_pid() {  # the pid of the prebuild that runs now (it holds run.lock), if any
  [[ -f "${P}/run.lock" ]] || return 1
  flock -n "${P}/run.lock" true 2>/dev/null && return 1
  cat "${P}/pid" 2>/dev/null || echo "?"
}

images_wanted() {  # prints why not, and fails, where the images are not to be built here
  case "${KUBETRAIN_PREBUILD_IMAGES:-auto}" in
    0) echo "KUBETRAIN_PREBUILD_IMAGES=0"; return 1 ;;
    1) return 0 ;;
  esac
  [[ "${CI:-}" == true ]] && return 0
  local why
  why="$("${HACK_DIR}/images.sh" check 2>&1)" || { echo "${why##*ERROR: }"; return 1; }
}

go_part_present() { [[ -f "$(bin_path "$1")" ]]; }

# part <name> <command...>: one part of a lane, with its events and a line in the log.
part() {
  local name="$1" start=$SECONDS rc=0
  shift
  event "$name" start
  progress "${name} started"
  "$@" || rc=$?
  if ((rc == 0)); then
    event "$name" "done" $((SECONDS - start))
    progress "${name} done in $((SECONDS - start))s"
  else
    event "$name" fail $((SECONDS - start))
    progress "${name} FAILED after $((SECONDS - start))s (exit ${rc}; log ${LOGF}); what needs it builds it again"
  fi
  return "$rc"
}

go_lane() {
  local c
  for c in "${PREBUILD_ORDER[@]}"; do
    if go_part_present "$c"; then event "$c" present; continue; fi
    part "$c" "${HACK_DIR}/build.sh" "$c" || true  # the next part still builds; the test that needs this one retries it
  done
}

images_lane() {
  if [[ "${CI:-}" == true ]]; then
    # The packages buildah, skopeo, debootstrap and containerd come from here (cluster-up installs them too).
    part node-deps flock "${KUBETRAIN_CACHE}/.node-deps.lock" "${HACK_DIR}/node-deps.sh" || return 0
  fi
  part image-operator "${HACK_DIR}/images.sh" operator || true
  part image-trainer "${HACK_DIR}/images.sh" trainer || true
}

run() {  # fd 8 holds run.lock while it runs (taken by `start`, or here); no child keeps it
  local why="" lanes=() start=$SECONDS go_parts=() c
  mkdir -p "$P"
  if [[ "${PREBUILD_LOCKED:-}" != 1 ]]; then
    exec 8>>"${P}/run.lock"
    flock -n 8 || die "another hack/prebuild.sh runs (pid $(cat "${P}/pid" 2>/dev/null))"
  fi
  unset PREBUILD_LOCKED
  echo "$$" >"${P}/pid"
  : >"$PROGRESS"
  echo "$(date +%s) - begin" >"$STATUS"
  export KUBETRAIN_BUILD_OWNER="hack/prebuild.sh, log ${LOGF}"
  if command -v go >/dev/null; then
    for c in "${PREBUILD_ORDER[@]}"; do go_part_present "$c" || go_parts+=("$c"); done
  else
    log "prebuild: no Go on PATH: the Go parts are not built (the tests that need them skip, or fail under CI=true)"
  fi
  if why="$(images_wanted)"; then lanes=(images); else log "prebuild: images not built here: ${why}"; fi
  event - plan go "${go_parts[@]}"
  if [[ ${#lanes[@]} -gt 0 ]]; then
    local img=("${IMAGE_PARTS[@]}")
    [[ "${CI:-}" != true ]] || img=(node-deps "${img[@]}")
    event - plan images "${img[@]}"
  fi
  progress "building Go: ${go_parts[*]:-nothing}; images: $([[ ${#lanes[@]} -gt 0 ]] && echo "operator trainer" || echo "no (${why})")"
  local go_pid="" images_pid=""
  if [[ ${#go_parts[@]} -gt 0 ]]; then go_lane 8>&- & go_pid=$!; fi
  if [[ ${#lanes[@]} -gt 0 ]]; then images_lane 8>&- & images_pid=$!; fi
  [[ -z "$go_pid" ]] || wait "$go_pid" || true
  [[ -z "$images_pid" ]] || wait "$images_pid" || true
  event - end $((SECONDS - start))
  progress "finished in $((SECONDS - start))s"
  status
}

start() {  # takes run.lock and hands it to the background run, so two starts never start two
  mkdir -p "$P"
  exec 8>>"${P}/run.lock"
  if ! flock -n 8; then
    log "prebuild: already running (pid $(cat "${P}/pid" 2>/dev/null); log ${LOGF})"
    return 0
  fi
  PREBUILD_LOCKED=1 setsid "$0" run >"$LOGF" 2>&1 </dev/null &
  log "prebuild: building what the tests need in the background (pid $!; log ${LOGF}; hack/prebuild.sh status)"
}

# summary [--line]: from the status file: what is built (and its time), failed, building (for how long),
# left. --line: on one line, for the progress file and the test log.
summary() {
  awk -v now="$(date +%s)" -v one="${1:-}" -v pid="$(running_pid || true)" -v logf="$LOGF" '
    function fmt(s) { s = int(s); return s >= 60 ? sprintf("%dm%02ds", s / 60, s % 60) : s "s" }
    NR == 1 { first = $1 }
    $3 == "plan" { for (i = 5; i <= NF; i++) order[++n] = $i }
    $3 == "start" { st[$2] = $1 }
    $3 == "done" { dn[$2] = $4; built = built (built ? ", " : "") $2 " " fmt($4) }
    $3 == "fail" { fl[$2] = $4; failed = failed (failed ? ", " : "") $2 " after " fmt($4) }
    $3 == "present" { present++; st[$2] = $1; dn[$2] = 0 }
    $3 == "end" { end = $4 }
    END {
      for (i = 1; i <= n; i++) {
        p = order[i]
        if (!(p in st)) left = left (left ? " " : "") p
        else if (!(p in dn) && !(p in fl)) building = building (building ? ", " : "") p " (" fmt(now - st[p]) " so far)"
      }
      if (end != "") head = "finished in " fmt(end)
      else if (pid != "") head = "running for " fmt(now - first) " (pid " pid ")"
      else head = "stopped before it finished"
      if (one) {
        printf "building: %s; left: %s\n", building ? building : "-", left ? left : "-"
        exit
      }
      print "prebuild: " head "; log " logf
      if (built) print "  built:    " built
      if (failed) print "  FAILED:   " failed " (see the log)"
      if (building) print "  building: " building
      if (left) print "  left:     " left
      if (present) print "  already built before: " present " parts"
    }' "$STATUS"
}

status() {
  [[ -s "$STATUS" ]] || { echo "prebuild: has not run here (hack/prebuild.sh start)"; return 0; }
  summary
}

wait_done() {
  local pid
  while pid="$(running_pid)"; do
    status
    for _ in $(seq "$PROGRESS_S"); do pid_alive "$pid" || break; sleep 1; done
  done
  status
  ! grep -q ' fail ' "$STATUS" 2>/dev/null
}

case "${1:-}" in
  start) start ;;
  run) run ;;
  status) status ;;
  wait) wait_done ;;
  *) die "usage: $0 start | run | status | wait" ;;
esac
