"""Hangs and dead ranks that name the rank: a flight recorder of the last collectives, a
heartbeat in the job's store, and one error when a collective fails.

Every collective of :mod:`megalite.parallel.collectives` (pipeline p2p and the context
parallel ring included) goes through :meth:`FlightRecorder.begin` / :meth:`~FlightRecorder.end`:
a per-group sequence number (``tp #57`` is this rank's 57th collective on its tp group;
every member of a group issues the same collectives in the same order, so the numbers
agree across the group) and an entry ``{group, ranks, op, seq, shapes, start, end}`` in a
ring buffer of the last :data:`RING_SIZE` collectives. That is all the hot path does.

:func:`start` (the entrypoint, once torch.distributed is up) adds a daemon thread that
publishes, every few seconds, this rank's progress to the job's c10d store (the default
group's store, under ``megalite/watchdog/``): the last completed sequence number per group,
the collectives in flight, its pid, host and addresses, its interval, and the time.

The heartbeat interval scales with the timeout (:func:`heartbeat_interval`: 5 s under the
default 10 minutes, 0.5 s at a few seconds): a heartbeat older than ``STALE_BEATS``
intervals means the rank stopped. On this host a peer's process is looked up in /proc;
on another host (cluster nodes) there is no /proc to read, so a peer whose host reset the
connection (gloo names the address in its error; each heartbeat carries the rank's
addresses) is named as gone, and after a reset a peer elsewhere whose heartbeat still
looks fresh is watched for two more intervals: a heartbeat that does not advance means it
is gone.

When a collective fails (gloo raises after ``--distributed-timeout-minutes`` without the
peers, or at once with "Connection reset/closed by peer" when a peer process died),
:meth:`FlightRecorder.fault` reads the other members' heartbeats (bounded: the store lives
in rank 0's process, which may be the one that stopped), names the members that never
reached that sequence number and what became of them (stopped: the heartbeat froze; gone:
the process no longer exists or the connection broke; busy: the collective it is stuck in),
writes the flight recorder to ``<dir>/flight_recorder/rank<R>.json`` (:func:`start`) and
returns a
:class:`DistributedFaultError` (exit code 8) with one line saying all of that. Under NCCL,
whose waits do not block the CPU, torch's own NCCL watchdog enforces the timeout.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import threading
import time
from collections import deque

import torch.distributed as dist

from megalite.errors import EXIT_DISTRIBUTED, KnownError

RING_SIZE = 64
STALE_BEATS = 3          # heartbeats missed before a rank counts as stopped
PREFIX = "megalite/watchdog/"
DIR_ENV = "MEGALITE_FLIGHT_RECORDER_DIR"
_TIMEOUT_WORDS = ("timed out", "timeout")
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
_GONE_WORDS = ("connection reset", "connection closed", "closed by peer", "broken pipe",
               "connection refused", "pair closure", "socket closed", "end of file")


class DistributedFaultError(KnownError, RuntimeError):
    """A collective did not complete: a member rank stopped, hung or died."""

    exit_code = EXIT_DISTRIBUTED


def fault_kind(exc: BaseException) -> str | None:
    """``"timeout"`` or ``"gone"`` for a communication failure of gloo/NCCL, None for any
    other error (a programming error keeps its own message)."""
    text = str(exc).lower()
    if any(w in text for w in _GONE_WORDS):
        return "gone"
    if any(w in text for w in _TIMEOUT_WORDS):
        return "timeout"
    return None


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats under a collective timeout of ``timeout_s``: 1/120 of it,
    within 0.5-5 s (5 s at the default 10 minutes; a dead rank elsewhere is then told
    from a slow one ``STALE_BEATS`` intervals after its last beat, long before the
    timeout)."""
    return min(max(timeout_s / 120.0, 0.5), 5.0)


def peer_address(exc: BaseException) -> str | None:
    """The peer address gloo names in a broken-connection error (``Connection closed by
    peer [10.0.0.2]:43210``), or None."""
    found = _PEER_ADDRESS.search(str(exc))
    return found.group(1) if found else None


def own_addresses() -> list[str]:
    """The addresses peers may see this rank at: the one on the route to ``MASTER_ADDR``
    and the one this host's name resolves to."""
    found = []
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                found.append(probe.getsockname()[0])
        except OSError:
            pass
    try:
        found.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    return list(dict.fromkeys(found))


def _addresses_of(host: str) -> list[str]:
    """The addresses ``host`` resolves to ([] when it does not)."""
    try:
        return [host] + [info[4][0] for info in socket.getaddrinfo(host, None)]
    except OSError:
        return [host]


def _proc_state(pid: int) -> str | None:
    """``"gone"``, ``"stopped"`` or ``"running"`` for a process on this host (from
    /proc), None where /proc says nothing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return None
    return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state, "running")


def _label(e: dict) -> str:
    return f"{e['group']} {e['op']} #{e['seq']}"


class FlightRecorder:
    """This process's record of its collectives (one per process: :data:`RECORDER`)."""

    def __init__(self, size: int = RING_SIZE):
        self.ring: deque = deque(maxlen=size)
        self.seqs: dict[str, int] = {}       # group name -> last issued sequence number
        self.done: dict[str, int] = {}       # group name -> last completed one
        self.comm_seconds = 0.0              # time blocked in collectives (stragglers)
        self.timeout_s: float | None = None
        self.dump_dir: str | None = None
        self.store = None
        self.rank = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.interval = 1.0
        self.addresses: list[str] = []

    # -- the hot path --------------------------------------------------------------------
    def begin(self, group: str, ranks, op: str, shapes, key: str = "") -> dict:
        """Record the start of collective ``op`` on group ``group`` (its global ``ranks``);
        returns the entry to hand to :meth:`end` / :meth:`fault`. Point-to-point batches
        (``key="p2p"``) are numbered apart: their count differs between the members."""
        name = group + key
        seq = self.seqs[name] = self.seqs.get(name, 0) + 1
        entry = {"group": group, "ranks": ranks, "op": op, "seq": seq, "shapes": shapes,
                 "start": time.time(), "end": None}
        self.ring.append(entry)
        return entry

    def end(self, entry: dict, since: float | None = None) -> None:
        """Mark ``entry`` complete; the time since ``since`` (default: its start) counts as
        blocked in communication (:attr:`comm_seconds`)."""
        now = entry["end"] = time.time()
        self.comm_seconds += now - (entry["start"] if since is None else since)
        if not entry["op"].startswith("p2p") and entry["seq"] > self.done.get(entry["group"], 0):
            self.done[entry["group"]] = entry["seq"]

    # -- the heartbeat -------------------------------------------------------------------
    def heartbeat(self) -> dict:
        """What this rank publishes: time, pid, host, progress and collectives in flight."""
        inflight = [{k: e.get(k) for k in ("group", "ranks", "peers", "op", "seq", "start")}
                    for e in list(self.ring) if e["end"] is None]
        return {"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                "addrs": self.addresses, "interval": self.interval,
                "done": dict(self.done), "inflight": inflight}

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.set(f"hb/{self.rank}", json.dumps(self.heartbeat()))
            except Exception:   # the store went away (its host rank exited): stop beating
                return
            self._stop.wait(self.interval)

    # -- a failure -----------------------------------------------------------------------
    def _read_peers(self, ranks, budget_s: float) -> tuple[dict, str | None]:
        """Heartbeats and fault notes of ``ranks`` from the store, waiting at most
        ``budget_s`` (the store's host may be stopped): ``({rank: record}, problem)``."""
        out: dict = {}
        result: dict = {}

        def read():
            try:
                for r in ranks:
                    rec = {}
                    for key in ("hb", "fault"):
                        name = f"{key}/{r}"
                        if self.store.check([name]):
                            rec[key] = self.store.get(name).decode()
                    out[r] = rec
            except Exception as exc:   # the store's host is gone
                result["problem"] = f"the store (served by rank 0) is unreachable: {exc}"

        if self.store is None:
            return {}, "no heartbeats (the watchdog was not started)"
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(budget_s)
        if reader.is_alive():
            return out, "the store (served by rank 0) did not answer"
        return out, result.get("problem")

    def _explain(self, entry: dict, now: float, budget: float, depth: int = 0,
                 reset_by: str | None = None, kind: str | None = None) -> list[str]:
        """Why the other members of ``entry`` (a collective of this rank, or one a peer is
        stuck in) did not complete it: one phrase per member that never arrived; a member
        stuck in another collective is followed one level further. ``kind`` ``"gone"``: a
        peer closed the connection (``reset_by``: its address, from gloo's error)."""
        peers = [r for r in (entry.get("peers") or entry["ranks"]) if r != self.rank]
        recs, problem = self._read_peers(peers, budget)
        if kind == "gone":
            recs = self._second_look(entry, recs, now, budget, reset_by)
        missing = []
        for r in peers:
            if r not in recs and problem:
                master = os.environ.get("MASTER_ADDR", "")
                if r == 0 and reset_by is not None and reset_by in _addresses_of(master):
                    missing.append(f"rank 0 on host {master} is gone (its connection from "
                                   f"{reset_by} was reset, and the job's store, which it "
                                   "served, with it)")
                else:
                    missing.append(f"rank {r} is not responding (the job's store, which it "
                                   "serves, did not answer either)" if r == 0 else
                                   f"rank {r}: unknown ({problem})")
                problem = None if r == 0 else problem
                continue
            why = self._describe(r, recs.get(r), entry, now, reset_by)
            if why is None:
                continue
            if isinstance(why, dict):   # stuck in another collective: who is it waiting for?
                text = (f"rank {r} is stuck in {_label(why)} on ranks {why['ranks']} for "
                        f"{now - why['start']:.1f} s")
                if depth == 0:
                    inner = self._explain(why, now, budget, depth + 1)
                    inner = [m for m in inner if not m.startswith(f"rank {r} ")]
                    if inner:
                        text += f", waiting for: {', '.join(inner)}"
                why = text
            missing.append(why)
        if problem and all(r in recs for r in peers):
            missing.append(problem)
        return missing

    def _reached(self, hb: dict, entry: dict) -> bool:
        """Whether the heartbeat ``hb`` shows its rank at or past ``entry`` (for p2p:
        never decided here)."""
        if entry["op"].startswith("p2p"):
            return False
        if hb["done"].get(entry["group"], 0) >= entry["seq"]:
            return True
        return any(e["group"] == entry["group"] and e["seq"] == entry["seq"]
                   for e in hb["inflight"])

    def _second_look(self, entry: dict, recs: dict, now: float, budget: float,
                     reset_by: str | None) -> dict:
        """After a broken connection: the peers that did not reach ``entry`` and whose
        heartbeat still looks fresh (it may predate their death by up to an interval) --
        on other hosts, or here with their process still running (a killed process takes
        a moment to exit on a loaded machine) -- are read again once two intervals passed
        since their last beat; a record whose heartbeat did not advance is marked
        ``"silent"``."""
        here = socket.gethostname()
        watch = {}
        for r, rec in recs.items():
            if "hb" not in rec or "fault" in rec:
                continue
            hb = json.loads(rec["hb"])
            interval = float(hb.get("interval", self.interval))
            elsewhere = hb["host"] != here
            unclear = (reset_by not in hb.get("addrs", []) if elsewhere
                       else _proc_state(hb["pid"]) == "running")   # may be exiting still
            if (unclear and not self._reached(hb, entry)
                    and now - hb["time"] <= max(STALE_BEATS * interval, 2.0)):
                watch[r] = (hb["time"], hb["time"] + 2 * interval + 0.5)
        if not watch:
            return recs
        wait = min(max(until for _, until in watch.values()) - time.time(), budget)
        if wait > 0:
            time.sleep(wait)
        again, _ = self._read_peers(list(watch), budget)
        for r, (beat, _) in watch.items():
            rec = again.get(r)
            if rec and "hb" in rec and json.loads(rec["hb"])["time"] == beat:
                recs[r] = dict(rec, silent="1", reread="1")
            elif rec:
                recs[r] = dict(rec, reread="1")
        return recs

    def _describe(self, peer: int, rec: dict | None, entry: dict, now: float,
                  reset_by: str | None = None):
        """Why ``peer`` did not complete ``entry``: a phrase, the in-flight entry it is
        stuck in (a dict), or None when it did reach it (it waits in the same
        collective)."""
        if rec is None:
            return f"rank {peer}: unknown"
        if "fault" in rec:
            return f"rank {peer} failed first ({rec['fault']})"
        if "hb" not in rec:
            return f"rank {peer} never sent a heartbeat"
        hb = json.loads(rec["hb"])
        p2p = entry["op"].startswith("p2p")
        if self._reached(hb, entry):
            return None
        elsewhere = hb["host"] != socket.gethostname()
        state = None if elsewhere else _proc_state(hb["pid"])
        age = (time.time() if "reread" in rec else now) - hb["time"]
        last = hb["done"].get(entry["group"], 0)
        where = (f"its last heartbeat {age:.1f} s ago" if p2p
                 else f"its last heartbeat had {entry['group']} #{last} done")
        if state == "gone":
            return f"rank {peer} is gone (process {hb['pid']} exited; {where})"
        if elsewhere and reset_by is not None and reset_by in hb.get("addrs", []):
            return (f"rank {peer} on host {hb['host']} is gone (its connection from "
                    f"{reset_by} was reset; {where})")
        if "silent" in rec:
            return (f"rank {peer} on host {hb['host']} is gone (the connection was reset "
                    f"and its heartbeat stopped {age:.1f} s ago; {where})")
        interval = float(hb.get("interval", self.interval))
        if state == "stopped" or age > max(STALE_BEATS * interval, 2.0):
            if elsewhere:   # no /proc to tell a hung process from a dead one: gone
                return (f"rank {peer} on host {hb['host']} is gone (no heartbeat for "
                        f"{age:.1f} s, over {STALE_BEATS} of its {interval:g} s intervals; "
                        f"{where})")
            how = "stopped" if state == "stopped" else "not responding"
            return f"rank {peer} is {how} (no heartbeat for {age:.1f} s; {where})"
        stuck = [e for e in hb["inflight"] if not (p2p and e["group"] == entry["group"])]
        if stuck:
            return min(stuck, key=lambda e: e["start"])
        if p2p:
            return None
        return (f"rank {peer} is alive (heartbeat {age:.1f} s ago) but has not reached it "
                f"({where})")

    def fault(self, entry: dict, exc: BaseException) -> BaseException:
        """The error to raise for ``exc`` from ``entry``'s collective: a
        :class:`DistributedFaultError` naming the group, the op and the ranks that never
        arrived (the flight recorder is written first), or ``exc`` itself when it is not a
        communication failure."""
        kind = fault_kind(exc)
        if kind is None:
            return exc
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
        now = time.time()
        elapsed = now - entry["start"]
        budget = 3.0 if self.timeout_s is None else min(10.0, max(2.0, self.timeout_s / 3))
        missing = self._explain(entry, now, budget, reset_by=peer_address(exc), kind=kind)
        if not missing:
            missing = [f"every member reached it ({str(exc).strip()[:160]})"]
        what = (f"did not complete within {elapsed:.1f} s"
                + (f" (--distributed-timeout-minutes {self.timeout_s / 60:g})"
                   if self.timeout_s else "")
                if kind == "timeout" else
                f"failed after {elapsed:.1f} s: a peer closed the connection")
        head = (f"{entry['group']} {entry['op']} #{entry['seq']} on ranks {entry['ranks']} "
                f"{what}")
        path = self.dump(head, missing)
        message = (f"distributed: {head}: {'; '.join(missing)}; "
                   f"flight recorder: {path or 'not written'}")
        if self.store is not None:
            note = threading.Thread(target=self._note, args=(f"{head}: {'; '.join(missing)}",),
                                    daemon=True)
            note.start()
            note.join(1.0)
        return DistributedFaultError(message)

    def _note(self, text: str) -> None:
        try:
            self.store.set(f"fault/{self.rank}", text)
        except Exception:
            pass

    def dump(self, head: str, missing: list[str]) -> str | None:
        """Write the flight recorder JSON; returns its path (None if it cannot be written)."""
        root = os.environ.get(DIR_ENV) or self.dump_dir or os.path.join(
            tempfile.gettempdir(), f"megalite-{os.environ.get('MASTER_PORT', os.getpid())}")
        path = os.path.join(root, "flight_recorder", f"rank{self.rank}.json")
        record = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                  "time": time.time(), "error": head, "missing": missing,
                  "timeout_s": self.timeout_s, "done": self.done, "collectives": list(self.ring)}
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(record, f, indent=1, default=str)
        except OSError:
            return None
        return path


RECORDER = FlightRecorder()


def start(timeout_minutes: float, dump_dir: str | None = None) -> None:
    """Start this rank's heartbeat (a daemon thread) on the default group's store and set
    the timeout the errors quote and where the flight recorder goes:
    ``$MEGALITE_FLIGHT_RECORDER_DIR``, else ``dump_dir`` (the entrypoint passes the folder
    of ``--metrics-jsonl``), else ``<tmp>/megalite-<MASTER_PORT>``; a ``flight_recorder``
    folder in it. A no-op without torch.distributed or when already started."""
    rec = RECORDER
    rec.timeout_s = timeout_minutes * 60.0
    rec.dump_dir = dump_dir
    if rec._thread is not None or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() == 1:
        return
    rec.rank = dist.get_rank()
    rec.store = dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())
    rec.interval = heartbeat_interval(rec.timeout_s)
    rec.addresses = own_addresses()
    rec._stop.clear()
    rec._thread = threading.Thread(target=rec._beat, name="megalite-watchdog", daemon=True)
    rec._thread.start()


def stop() -> None:
    """Stop the heartbeat (before the process group is destroyed)."""
    rec = RECORDER
    if rec._thread is None:
        return
    rec._stop.set()
    rec._thread.join(timeout=2 * rec.interval + 1.0)
    rec._thread = None
    rec.store = None
