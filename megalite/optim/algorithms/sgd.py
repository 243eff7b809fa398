"""``--optimizer sgd``: SGD with ``--sgd-momentum`` (torch's form: the first step's buffer
is the gradient itself). State: ``momentum_buffer`` when the momentum is not 0;
element-wise, so exact on any piece of a tensor."""

from __future__ import annotations

import torch

from megalite.optim.algorithms.base import Algorithm, foreach_or_fused


class SGD(Algorithm):
    name = "sgd"

    def state_keys(self, ocfg, rule=None):
        return ("momentum_buffer",) if ocfg.sgd_momentum else ()

    def build(self, groups, ocfg):
        return torch.optim.SGD(groups, lr=ocfg.lr, momentum=ocfg.sgd_momentum,
                               weight_decay=ocfg.weight_decay, **foreach_or_fused(groups))

    def state_floats(self, ocfg, rule=None):
        return 1    # the memory estimates count the buffer whatever the momentum


ALGORITHM = SGD()
