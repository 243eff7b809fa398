"""Exit codes of megalite's entrypoints, and the one line a known error prints.

==== ===========================================================================
code meaning
==== ===========================================================================
0    finished, or stopped on ``--exit-interval`` / ``--exit-duration-in-mins`` /
     SIGTERM with ``--exit-signal-handler`` (after its save)
1    anything else: an unexpected exception (its traceback is printed)
2    configuration: a bad flag, YAML field or layout (``ConfigError`` and subclasses)
3    data: dataset prefixes, ``.bin``/``.idx`` files, tokenizers, token ids,
     preprocessing (``DataBuildError``, ``IndexedDatasetError``, ``TokenizerError``,
     ``TokenIdError``, ``PreprocessError``)
4    checkpoint: a missing, foreign, damaged or locked checkpoint (``CheckpointError``)
5    numerical: a NaN/Inf loss or a collapsed loss scale (``NonFiniteLossError``,
     ``LossScaleError``, or any subclass of :class:`NumericalError`), including a
     suspicious step that reproduced exactly on re-run (``DeterministicFaultError``, from
     ``--rerun-mode validate_results``): the data or the model; restarting will not help
6    transient faults: re-runs of suspicious steps gave other results too often
     (``TransientFaultError``); suspect the hardware, restart without the named ranks' nodes
8    distributed: a rank died or hung; a collective did not complete within
     ``--distributed-timeout-minutes`` (``DistributedFaultError``, naming the group, the
     operation and the ranks that never arrived; ``megalite.parallel.watchdog``)
==== ===========================================================================

A known error prints one line per rank on stderr, ``megalite: error (rank R): ...``;
``MEGALITE_TRACEBACK=1`` prints its traceback first.

Each known error class declares its code by deriving from :class:`KnownError` (through
:class:`DataError`, :class:`NumericalError`, or with its own ``exit_code``); this module
imports nothing of megalite, so every layer can import it.
"""

from __future__ import annotations

import os
import sys
import traceback

EXIT_OK = 0
EXIT_UNKNOWN = 1
EXIT_CONFIG = 2
EXIT_DATA = 3
EXIT_CHECKPOINT = 4
EXIT_NUMERICAL = 5
EXIT_TRANSIENT_FAULT = 6
EXIT_DISTRIBUTED = 8


class KnownError(Exception):
    """Base of the errors megalite reports as one line; ``exit_code`` is the process exit
    code. A subclass also derives from the builtin type callers catch (ValueError, ...)."""

    exit_code = EXIT_UNKNOWN


class DataError(KnownError):
    """Dataset prefixes, ``.bin``/``.idx`` files, tokenizers, token ids, preprocessing."""

    exit_code = EXIT_DATA


class NumericalError(KnownError, RuntimeError):
    """A NaN/Inf loss or a loss scale that cannot learn."""

    exit_code = EXIT_NUMERICAL


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code of a known megalite exception, None for any other."""
    return exc.exit_code if isinstance(exc, KnownError) else None


def report_error(exc: BaseException, rank: int | None = None, *, prog: str = "megalite",
                 file=None) -> int | None:
    """Print ``<prog>: error (rank R): <message>`` for a known exception and return its
    exit code (the traceback too when ``MEGALITE_TRACEBACK=1``); None, printing nothing,
    for an unknown one (re-raise it to keep its traceback)."""
    code = exit_code_of(exc)
    if code is None:
        return None
    file = sys.stderr if file is None else file
    if os.environ.get("MEGALITE_TRACEBACK") == "1":
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=file)
    where = "" if rank is None else f" (rank {rank})"
    print(f"{prog}: error{where}: {_one_line(str(exc))}", file=file, flush=True)
    return code


def report_tool_error(prog: str, exc: BaseException,
                      usage: tuple[type[BaseException], ...] = (ValueError, OSError)) -> int | None:
    """For a tool's ``main``: print ``<prog>: error: <message>`` for a known megalite error
    (returning its exit code) or one of the ``usage`` errors (a bad argument or path:
    exit code 2); None, printing nothing, for anything else (re-raise it)."""
    code = exit_code_of(exc)
    if code is None and not isinstance(exc, usage):
        return None
    print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr, flush=True)
    return code or EXIT_CONFIG


def _one_line(message: str) -> str:
    """``message`` without the worker traceback a DataLoader worker's exception carries
    when the main process re-raises it ("Caught X in DataLoader worker process N.
    Original Traceback ...": the original message is the traceback's last line)."""
    if "Original Traceback" not in message:
        return message
    last = [line for line in message.splitlines() if line.strip()][-1]
    head, sep, rest = last.partition(": ")
    return rest if sep and "Error" in head else last


def record_exit_code(code: int) -> None:
    """Leave this rank's exit code where its launch script can read it.

    torchrun exits 1 whenever a worker exits non-zero, and also after forwarding a SIGTERM
    to workers that saved and exited 0, so its own code says neither which error happened
    nor that a signal-triggered save succeeded. The launch scripts (``scripts/
    _forward_sigterm.sh``) set ``MEGALITE_EXIT_CODE_DIR``; each rank writes its code to
    ``rank<RANK>`` there, and the script exits with the ranks' code instead of torchrun's.
    """
    folder = os.environ.get("MEGALITE_EXIT_CODE_DIR")
    if not folder:
        return
    try:
        path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}")
        with open(path, "w") as f:
            f.write(f"{int(code)}\n")
    except OSError:   # the script then keeps torchrun's code
        pass
