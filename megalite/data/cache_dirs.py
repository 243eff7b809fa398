"""Where the data pipeline writes the files it makes at run time.

Nothing is written into megalite's own tree (the repository checkout, or the installed
package): that tree may be read-only, shared, or a site-packages folder. Files that would
land there go to the user cache directory instead:

    $MEGALITE_CACHE_DIR, else $XDG_CACHE_HOME/megalite, else ~/.cache/megalite

Dataset index caches (GPTDataset / BlendedDataset indices):
    --data-cache-path DIR given          DIR (Megatron's meaning, unchanged)
    data outside megalite's tree         <data dir>/cache/GPTDataset_indices (as Megatron)
    data inside it (the bundled corpus)  <user cache dir>/GPTDataset_indices
Other tokenizations of the bundled corpus: ``<user cache dir>/bundled`` (see bundled.py).

Cache names hold an md5 of everything they depend on, the data's absolute path included,
so one user cache directory serves any number of datasets and checkouts.
"""

from __future__ import annotations

import os
from pathlib import Path

# The folder holding the ``megalite`` package: the repository root of a checkout (with
# ``data/`` in it), or site-packages for an installed copy.
SOURCE_ROOT = Path(__file__).resolve().parents[2]

INDEX_CACHE_SUBDIR = "GPTDataset_indices"


def user_cache_dir() -> str:
    """``$MEGALITE_CACHE_DIR``, else ``$XDG_CACHE_HOME/megalite``, else
    ``~/.cache/megalite`` (absolute; read at each call, so a run may set it late)."""
    explicit = os.environ.get("MEGALITE_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join("~", ".cache")
    return os.path.abspath(os.path.join(os.path.expanduser(base), "megalite"))


def inside_source_tree(path: str) -> bool:
    """True when ``path`` lies in megalite's own tree (:data:`SOURCE_ROOT`)."""
    resolved = Path(path).resolve()
    return resolved == SOURCE_ROOT or SOURCE_ROOT in resolved.parents


def default_index_cache_dir(prefix: str) -> str:
    """Where the index caches of the dataset at ``prefix`` go without --data-cache-path:
    next to the data as Megatron does, unless the data lies in megalite's own tree."""
    data_dir = os.path.dirname(os.path.abspath(prefix))
    if inside_source_tree(data_dir):
        return os.path.join(user_cache_dir(), INDEX_CACHE_SUBDIR)
    return os.path.join(data_dir, "cache", INDEX_CACHE_SUBDIR)
