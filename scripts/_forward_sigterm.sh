# Sourced by the launch scripts: run torchrun so that a SIGTERM to the script ends the job
# with exit code 0 after the workers' --exit-signal-handler save.
#
# A SIGTERM that reaches torchrun itself makes it raise SignalException: it terminates the
# workers (they save) and then exits 1 with a traceback. So the script does not exec
# torchrun; it runs it as a child and sends a SIGTERM to the script on to torchrun's
# workers (its child processes) only. They save, exit 0, and torchrun exits 0; the script
# exits with torchrun's code.
#
#   run_forwarding_sigterm "$PYTHON" -m torch.distributed.run ...

_megalite_forward_sigterm() {
  # the workers when they have started, else torchrun itself
  pkill -TERM -P "$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null || true
}

run_forwarding_sigterm() {
  "$@" &
  local child=$! rc=0
  # shellcheck disable=SC2064  # expand $child now
  trap "_megalite_forward_sigterm $child" TERM
  wait "$child" || rc=$?
  # a trapped signal interrupts `wait` (status > 128): wait again while torchrun runs
  while [ "$rc" -gt 128 ] && kill -0 "$child" 2>/dev/null; do
    rc=0
    wait "$child" || rc=$?
  done
  trap - TERM
  return "$rc"
}
