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
     ``LossScaleError``, or any subclass of :class:`NumericalError`)
==== ===========================================================================

A known error prints one line per rank on stderr, ``megalite: error (rank R): ...``;
``MEGALITE_TRACEBACK=1`` prints its traceback first.

Classes are matched by name along the exception's MRO (only classes defined in
megalite), so this module imports none of the modules that define them.
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


class NumericalError(RuntimeError):
    """Base class a numerical failure may derive from to get exit code 5."""


EXIT_CODES: dict[str, int] = {
    "ConfigError": EXIT_CONFIG,
    "DataBuildError": EXIT_DATA,
    "IndexedDatasetError": EXIT_DATA,
    "TokenizerError": EXIT_DATA,
    "TokenIdError": EXIT_DATA,
    "PreprocessError": EXIT_DATA,
    "CheckpointError": EXIT_CHECKPOINT,
    "NumericalError": EXIT_NUMERICAL,
    "NonFiniteLossError": EXIT_NUMERICAL,
    "LossScaleError": EXIT_NUMERICAL,
}


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code of a known megalite exception, None for any other."""
    for cls in type(exc).__mro__:
        if cls.__module__.split(".")[0] == "megalite" and cls.__name__ in EXIT_CODES:
            return EXIT_CODES[cls.__name__]
    return None


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
    print(f"{prog}: error{where}: {exc}", file=file, flush=True)
    return code
