"""Optimizer algorithms, one file per ``--optimizer`` value, behind one interface
(:class:`~megalite.optim.algorithms.base.Algorithm`): the plain and the distributed
optimizer, CPU offload, clipping and checkpoints use only that interface. A new optimizer
is a new file here with a module-level ``ALGORITHM`` and its line in :data:`ALGORITHMS`;
the values ``--optimizer`` accepts are read from :data:`ALGORITHMS`."""

from __future__ import annotations

from megalite.optim.algorithms import adam, lion, muon, sgd
from megalite.optim.algorithms.base import Algorithm

ALGORITHMS: dict[str, Algorithm] = {
    "adam": adam.ALGORITHM,
    "sgd": sgd.ALGORITHM,
    "muon": muon.ALGORITHM,
    "lion": lion.ALGORITHM,
}


def algorithm_of(ocfg) -> Algorithm:
    """The algorithm ``ocfg.optimizer`` names."""
    try:
        return ALGORITHMS[ocfg.optimizer]
    except KeyError:
        raise ValueError(f"unknown --optimizer {ocfg.optimizer!r}; one of "
                         f"{', '.join(ALGORITHMS)}") from None
