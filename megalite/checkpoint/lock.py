"""One job per ``--save`` directory: ``SAVE/.megalite.lock``.

Rank 0 of a job that saves creates the lock atomically (``O_CREAT | O_EXCL``) with its
host, pid, start time and a heartbeat, which a daemon thread rewrites every
``HEARTBEAT_SECONDS`` (a thread rather than the training loop: a step or an evaluation
can outlast any interval, and the heartbeat only says the process is alive); the lock
records that interval. A second job finds the lock and stops with one sentence naming the
holder, unless the lock is stale -- its heartbeat older than ``STALE_INTERVALS`` of the
holder's intervals (30 s by default), whatever the host, or its pid gone on this host --
in which case it is taken over with a log line saying why. A holder whose heartbeat is
already late (over 1.5 intervals: a node that died moments ago, which a restarted job
meets when its new rank 0 is on another host) is waited for until it is stale or beats
again, so the restart takes the lock over instead of stopping.
:meth:`SaveLock.release` removes it at every exit the process sees: a clean one, an error
(``build_components`` and the entrypoint release it on their way out), SIGTERM (the lock's
handler, installed while the default one is in place, releases it and then dies of the
signal as before); only a job killed outright (SIGKILL, a lost node) leaves it behind,
stale.

The same step refuses a fresh run in a directory that holds another run's checkpoints
(:func:`acquire_save_lock` with ``load`` elsewhere or unset): it would overwrite them, and
its later iterations would stay mixed in. The check runs under the lock, so two jobs cannot
both pass it; ``--overwrite-checkpoints`` deletes that run's checkpoints instead.

Readers take no lock. A job that only loads from a directory (``--load`` without ``--save``
there, ``tools/evaluate.py``, ``generate.py``, ``convert_checkpoint.py``) relies on how a
save is published instead: every file is written under ``iter_N.tmp/``, ``metadata.json``
last, the directory is renamed to ``iter_N`` and only then does
``latest_checkpointed_iteration.txt`` (replaced atomically) name it. So the iteration
``latest`` names is always complete, and a save in progress is invisible to readers. The
one way a live job changes a published directory -- re-saving an iteration that exists,
after a resume from an older ``--ckpt-step`` -- is caught by the loader, which re-reads
(see :mod:`megalite.checkpoint.load`). A reader lock would need write access to the
directory (read-only mounts, someone else's run) and would let a reader stall a training
job; neither is wanted. :func:`live_holder` lets a reader say that a live job is writing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time

from megalite.checkpoint.files import (
    ITER_RE,
    LATEST,
    CheckpointError,
    published_iterations,
    read_latest_iteration,
)

LOCK = ".megalite.lock"
HEARTBEAT_SECONDS = 10.0
STALE_INTERVALS = 3      # a lock whose heartbeat is older than this many intervals is stale
LATE_INTERVALS = 1.5     # ... and one older than this is waited for until stale or beating


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _read(path: str) -> dict:
    """The lock's fields; a lock being written (or unreadable) counts from its mtime."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        try:
            return {"heartbeat": os.path.getmtime(path)}
        except OSError:
            return {}


def holder_interval(info: dict) -> float:
    """The heartbeat interval the lock ``info`` records (older locks: the default)."""
    try:
        return max(float(info.get("interval", HEARTBEAT_SECONDS)), 0.1)
    except (TypeError, ValueError):
        return HEARTBEAT_SECONDS


def stale_after_of(info: dict) -> float:
    """Seconds without a heartbeat after which the lock ``info`` is stale."""
    return STALE_INTERVALS * holder_interval(info)


def stale_reason(info: dict, stale_after: float | None = None) -> str | None:
    """Why the lock ``info`` may be taken over, or None while its holder looks alive.
    ``stale_after``: seconds without heartbeat (default: :func:`stale_after_of`)."""
    limit = stale_after_of(info) if stale_after is None else stale_after
    age = time.time() - float(info.get("heartbeat", 0))
    if age > limit:
        return (f"its heartbeat is {age:.0f}s old (over {limit:.0f}s, "
                f"{limit / holder_interval(info):g} of its {holder_interval(info):g}s "
                "intervals): the holder is gone")
    if info.get("host") == socket.gethostname() and "pid" in info:
        if info["pid"] == os.getpid():
            return "it was left by an earlier run in this process"
        if not _pid_alive(int(info["pid"])):
            return f"pid {info['pid']} no longer runs on this host"
    return None


def live_holder(directory: str, stale_after: float | None = None) -> dict | None:
    """The lock fields of the live job (another process) saving to ``directory``, or
    None: no lock, a stale one, or this process's own."""
    path = os.path.join(directory, LOCK)
    if not os.path.exists(path):
        return None
    info = _read(path)
    if not info or stale_reason(info, stale_after) is not None:
        return None
    if info.get("host") == socket.gethostname() and info.get("pid") == os.getpid():
        return None
    return info


def _await_late_holder(path: str, stale_after: float | None, log,
                       max_wait: float | None = None) -> dict:
    """The lock's fields, once its holder is either on time or stale: a heartbeat late by
    over ``LATE_INTERVALS`` intervals (its holder probably died moments ago) is watched
    until it beats again or goes stale, at most ``STALE_INTERVALS`` intervals (and at
    most ``max_wait`` seconds: the other ranks wait in a collective meanwhile)."""
    info = _read(path)
    interval = holder_interval(info)
    limit = stale_after_of(info) if stale_after is None else stale_after
    age = time.time() - float(info.get("heartbeat", 0))
    if not (LATE_INTERVALS * interval < age <= limit) or stale_reason(info, stale_after):
        return info
    if max_wait is not None and limit - age > max_wait:
        return info
    log(f" the lock {path} of host {info.get('host', '?')} pid {info.get('pid', '?')} "
        f"has had no heartbeat for {age:.0f}s (interval {interval:g}s): waiting up to "
        f"{limit - age:.0f}s more for it to beat or go stale")
    while True:
        time.sleep(min(interval / 4, 1.0))
        now = _read(path)
        if now != info or stale_reason(now, stale_after) is not None:
            return now


class SaveLock:
    """The held lock of ``directory``; :meth:`acquire` it, :meth:`release` at exit."""

    def __init__(self, directory: str, heartbeat_seconds: float = HEARTBEAT_SECONDS):
        self.path = os.path.join(directory, LOCK)
        self.info = {"host": socket.gethostname(), "pid": os.getpid(),
                     "started": time.time(), "heartbeat": time.time(),
                     "interval": heartbeat_seconds}
        self._stop = threading.Event()
        self._interval = heartbeat_seconds
        self._thread: threading.Thread | None = None
        self._sigterm_installed = False

    @classmethod
    def acquire(cls, directory: str, *, stale_after: float | None = None,
                heartbeat_seconds: float = HEARTBEAT_SECONDS, log=print,
                max_wait: float | None = None) -> SaveLock:
        """Take the lock of ``directory`` (created if missing) or raise
        :class:`CheckpointError` naming the live job that holds it. ``stale_after``:
        seconds without heartbeat that make a lock stale (default: ``STALE_INTERVALS``
        of the interval the lock records); ``max_wait``: the longest wait for a late
        holder to go stale (None: as long as that takes)."""
        os.makedirs(directory, exist_ok=True)
        lock = cls(directory, heartbeat_seconds)
        for _ in range(3):
            try:
                fd = os.open(lock.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = _await_late_holder(lock.path, stale_after, log, max_wait)
                reason = stale_reason(info, stale_after)
                if reason is None:
                    age = time.time() - float(info.get("heartbeat", 0))
                    limit = stale_after_of(info) if stale_after is None else stale_after
                    raise CheckpointError(
                        f"--save {directory} is in use by another job (host "
                        f"{info.get('host', '?')}, pid {info.get('pid', '?')}, heartbeat "
                        f"{age:.0f}s ago): stop it or save elsewhere; if it is gone, delete "
                        f"{lock.path} (a lock is taken over by itself after "
                        f"{limit:.0f}s without heartbeat)") from None
                lock._take_over(info, reason, log)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(lock.info, f)
            lock._thread = threading.Thread(target=lock._beat, name="save-lock-heartbeat",
                                            daemon=True)
            lock._thread.start()
            lock._install_sigterm()
            return lock
        raise CheckpointError(f"could not take {lock.path}: other jobs keep taking it")

    def _take_over(self, info: dict, reason: str, log) -> None:
        """Move the stale lock aside (one taker wins the rename); if what was moved is not
        the lock judged stale (a new holder raced in), put it back."""
        aside = f"{self.path}.stale{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read(aside) != info:
            try:
                os.link(aside, self.path)
            finally:
                os.remove(aside)
            return
        os.remove(aside)
        log(f" taking over the lock {self.path} of host {info.get('host', '?')} pid "
            f"{info.get('pid', '?')}: {reason}")

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.refresh()
            except (OSError, CheckpointError) as exc:
                print(f" warning: {exc}", flush=True)
                return

    def refresh(self) -> None:
        """Rewrite the heartbeat (atomically); an error if another job took the lock."""
        held = _read(self.path)
        if {k: held.get(k) for k in ("host", "pid", "started")} != \
                {k: self.info[k] for k in ("host", "pid", "started")}:
            raise CheckpointError(f"{self.path} now belongs to host {held.get('host')} pid "
                                  f"{held.get('pid')}: another job took over this --save "
                                  "directory")
        self.info["heartbeat"] = time.time()
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.info, f)
        os.replace(tmp, self.path)

    def _install_sigterm(self) -> None:
        """Release the lock on SIGTERM when nothing else handles it (the default action,
        in the main thread); the process then dies of the signal as it would have."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm_installed = True

    def _on_sigterm(self, signum, frame) -> None:
        self.release()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        if self._sigterm_installed:
            self._sigterm_installed = False
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        held = _read(self.path)
        if held.get("pid") == self.info["pid"] and held.get("started") == self.info["started"]:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def other_run(directory: str) -> str | None:
    """What ``directory`` holds of a run's checkpoints, in a few words (the iteration its
    pointer names, its iteration directories), or None when it holds none (unpublished
    ``.tmp`` saves of a run that never finished one do not count)."""
    iterations = published_iterations(directory)
    has_pointer = os.path.exists(os.path.join(directory, LATEST))
    if not iterations and not has_pointer:
        return None
    try:
        latest = read_latest_iteration(directory)
    except CheckpointError:
        latest = None
    said = (f"up to iteration {latest}" if latest is not None else
            f"its {LATEST} unreadable")
    held = (f"{len(iterations)} iteration directories, {iterations[0]} to {iterations[-1]}"
            if len(iterations) > 1 else
            f"iteration directory {iterations[0]}" if iterations else "no iteration directory")
    return f"{said}: {held}"


def clear_checkpoints(directory: str) -> None:
    """Delete the checkpoints in ``directory``: the pointer first, then the iteration
    directories and unpublished saves."""
    pointer = os.path.join(directory, LATEST)
    if os.path.exists(pointer):
        os.remove(pointer)
    for entry in sorted(os.listdir(directory)):
        name = entry.split(".", 1)[0]
        if ITER_RE.fullmatch(name) and os.path.isdir(os.path.join(directory, entry)):
            shutil.rmtree(os.path.join(directory, entry))


def _check_fresh_run(directory: str, load: str | None, overwrite: bool, log) -> None:
    """Refuse (or, with ``overwrite``, clear) a ``--save`` directory that holds another
    run's checkpoints when this run does not load from it."""
    if _same_dir(directory, load):
        return
    found = other_run(directory)
    if found is None:
        return
    if overwrite:
        clear_checkpoints(directory)
        log(f" --overwrite-checkpoints: deleted the checkpoints of the run found in "
            f"{directory} ({found})")
        return
    loads = f"--load {load}" if load else "no --load"
    raise CheckpointError(
        f"--save {directory} already holds the checkpoints of a run ({found}) that this run "
        f"does not resume ({loads}): its saves would overwrite them. To continue that run "
        f"pass --load {directory}; to keep it, choose another --save; to delete it and "
        "start afresh, pass --overwrite-checkpoints")


def acquire_save_lock(directory: str, ps, log=print, *, load: str | None = None,
                      overwrite: bool = False) -> SaveLock | None:
    """:meth:`SaveLock.acquire` on rank 0, the outcome shared (collective): the lock on
    rank 0, None on the others, or the same :class:`CheckpointError` on every rank.

    Under the lock, a directory holding another run's checkpoints is refused unless
    ``load`` (``--load``) is the same directory; ``overwrite``
    (``--overwrite-checkpoints``) deletes them instead."""
    from megalite.checkpoint.save import raise_if_any

    from megalite.parallel.watchdog import RECORDER

    lock, error = None, None
    # the other ranks wait in a collective while rank 0 waits for a late lock: stay within
    # --distributed-timeout-minutes
    max_wait = None if RECORDER.timeout_s is None else 0.8 * RECORDER.timeout_s
    if ps.rank == 0:
        try:
            lock = SaveLock.acquire(directory, log=log, max_wait=max_wait)
            _check_fresh_run(directory, load, overwrite, log)
        except (CheckpointError, OSError) as exc:
            error = str(exc)
            if lock is not None:
                lock.release()
                lock = None
    raise_if_any(error, ps, "{error}")
    return lock
