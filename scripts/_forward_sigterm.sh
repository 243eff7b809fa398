# Sourced by the launch scripts: run torchrun so that the script exits with the workers'
# own exit code (0 after a SIGTERM-triggered --exit-signal-handler save, 2-6 for megalite's
# known errors: see docs/training.md for the exit codes), not torchrun's.
#
# A SIGTERM that reaches torchrun itself makes it raise SignalException: it terminates the
# workers (they save) and then exits 1 with a traceback. So the script does not exec
# torchrun; it runs it as a child and sends a SIGTERM to the script on to torchrun's
# workers (its child processes) only. They save, exit 0, and torchrun exits 0.
#
# torchrun runs as `python -m megalite.launch` (torchrun itself, but a signal that stops it
# -- Ctrl-C reaches every process of the job -- ends it with one line, not a traceback),
# and a SIGINT to the script is passed on to the workers like a SIGTERM.
#
# torchrun also exits 1 whenever any worker fails, whatever the worker's code. Each worker
# writes its code to $MEGALITE_EXIT_CODE_DIR/rank<RANK> (megalite.errors.record_exit_code):
# when torchrun fails and every local worker left a code, the script exits with the
# highest of them (0 when all saved and stopped cleanly, e.g. after SLURM signalled
# torchrun directly); a worker that crashed without one leaves torchrun's code.
#
#   run_forwarding_sigterm "$PYTHON" -m megalite.launch --nproc_per_node N ...

_megalite_forward_sigterm() {
  # the workers when they have started, else torchrun itself
  pkill -TERM -P "$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null || true
}

_megalite_forward_sigint() {
  # Ctrl-C reached every process of the job already; pass on a SIGINT sent to the script
  # alone (the workers ignore a repeat while they save)
  pkill -INT -P "$1" 2>/dev/null || true
}

# the value of torchrun's --nproc_per_node / --nproc-per-node among the arguments (1 if absent)
_megalite_nproc() {
  local prev="" arg
  for arg in "$@"; do
    case "$prev" in --nproc_per_node|--nproc-per-node) echo "$arg"; return ;; esac
    case "$arg" in --nproc_per_node=*|--nproc-per-node=*) echo "${arg#*=}"; return ;; esac
    prev=$arg
  done
  echo 1
}

# the workers' exit code when all $2 of them left one in folder $1, else nothing
_megalite_workers_code() {
  local folder=$1 expected=$2 code worst=0 n=0 f
  for f in "$folder"/rank*; do
    [ -f "$f" ] || continue
    code=$(cat "$f")
    n=$((n + 1))
    [ "$code" -gt "$worst" ] && worst=$code
  done
  [ "$n" -ge "$expected" ] && echo "$worst"
}

run_forwarding_sigterm() {
  local codes rc=0 child workers
  codes=$(mktemp -d "${TMPDIR:-/tmp}/megalite-exit.XXXXXX")
  MEGALITE_EXIT_CODE_DIR=$codes "$@" &
  child=$!
  # shellcheck disable=SC2064  # expand $child now
  trap "_megalite_forward_sigterm $child" TERM
  # shellcheck disable=SC2064
  trap "_megalite_forward_sigint $child" INT
  wait "$child" || rc=$?
  # a trapped signal interrupts `wait` (status > 128): wait again while torchrun runs
  while [ "$rc" -gt 128 ] && kill -0 "$child" 2>/dev/null; do
    rc=0
    wait "$child" || rc=$?
  done
  trap - TERM INT
  if [ "$rc" -ne 0 ]; then
    workers=$(_megalite_workers_code "$codes" "$(_megalite_nproc "$@")") || true
    if [ -n "$workers" ]; then
      echo "megalite: torchrun exited $rc; the workers' exit code is $workers" >&2
      rc=$workers
    fi
  fi
  rm -rf "$codes"
  return "$rc"
}
