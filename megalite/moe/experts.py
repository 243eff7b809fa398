"""The local experts of one MoE layer, computed as one grouped GEMM.

A rank of expert-parallel rank ``r`` holds experts ``r * E_l ... (r + 1) * E_l - 1``
(``E_l = E / ep``), stacked into one tensor per weight::

    fc1  [E_l, h, 2 * ffn / etp]   (SwiGLU: gate | up, each split over etp)
         [E_l, h, ffn / etp]       (otherwise, GeLU)
    fc2  [E_l, ffn / etp, h]
    fc1_bias [E_l, fc1 out], fc2_bias [E_l, h]   (with --add-bias-linear)

so ``y = act(x @ fc1[e]) @ fc2[e]`` for a token routed to local expert ``e``. Under expert
tensor parallelism (etp > 1) fc1 is split by columns and fc2 by rows, like a dense
tensor-parallel MLP: each etp rank returns a partial sum that the dispatcher reduces over
``ps.etp``; fc2's bias is added on etp rank 0 only and marked ``sequence_parallel``
(its gradient is summed over tp, which must then equal etp).

The grouped GEMM pads each expert's tokens to the largest count and runs ``torch.bmm``
(no Python loop over experts); under a zero-bubble schedule its weight gradients wait for
the W step (``megalite.parallel.weight_grad``). The per-expert loop it replaces lives in the tests.
Under ``--fp8-format`` both GEMMs run in fp8 with per-row scales
(:mod:`megalite.moe.fp8_experts`; their weight gradients are not deferred), the weights
quantised once per training step (``GroupedMLP.fp8_weights``).

Every parameter is marked ``expert`` (:class:`~megalite.parallel.params.ParamMeta`, with
the global index of its first expert): its gradient is reduced over ``ps.edp``, not
``ps.dp_cp``, and it is initialized per global expert (``layers.sharding.initialize_params``).
"""

from __future__ import annotations

import math

import torch

from megalite.layers.activations import activation
from megalite.layers.sharding import gather_full, initialize_params, shard
from megalite.moe.fp8_experts import Fp8ExpertWeights, fp8_expert_bmm
from megalite.parallel import weight_grad
from megalite.parallel.collectives import all_gather_list
from megalite.parallel.params import mark_param, update_meta


def padded_index(tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Where each of ``M`` expert-sorted rows goes in a ``[E_l * C, ...]`` padded buffer.

    ``tokens_per_expert`` ``[E_l]`` (CPU int64) -> (index ``[M]``, C = max count): row j of
    expert e's segment goes to ``e * C + j``.
    """
    counts = tokens_per_expert.to(torch.int64).cpu()
    total, cap = int(counts.sum()), int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    experts = torch.arange(counts.numel())
    shift = torch.repeat_interleave(experts * cap - starts, counts, output_size=total)
    return torch.arange(total) + shift, cap


class _DeferrableBmm(torch.autograd.Function):
    """``torch.bmm(x, w)`` (``[E, C, a] x [E, a, b] -> [E, C, b]``) whose weight gradient
    ``x^T g`` may be deferred to a zero-bubble W step (:mod:`megalite.parallel.weight_grad`);
    the gradients are the products autograd forms for ``torch.bmm``, bit for bit. Used
    only inside ``weight_grad.splittable()``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.bmm(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grad.bmm(w.transpose(1, 2))
        if ctx.needs_input_grad[1]:
            dw = weight_grad.weight_grad(w, lambda: x.transpose(1, 2).bmm(grad))
        return dx, dw


def _bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if weight_grad.split_enabled(x.device.type) and x.dtype == w.dtype:
        return _DeferrableBmm.apply(x, w)
    return torch.bmm(x, w)


def grouped_mlp(x: torch.Tensor, tokens_per_expert: torch.Tensor, fc1: torch.Tensor,
                fc2: torch.Tensor, *, swiglu: bool, fc1_bias=None, fc2_bias=None,
                fp8=None, etp_group=None, fp8_weights=None) -> torch.Tensor:
    """``x`` ``[M, h]`` sorted by expert -> ``[M, h]``; two ``bmm`` over padded tokens.

    fc1 ``[E_l, h, f1]``, fc2 ``[E_l, f, h]``, biases ``[E_l, f1]`` / ``[E_l, h]``. With
    ``fp8`` (an :class:`~megalite.layers.fp8.Fp8Recipe`) both run in fp8 with per-row
    scales (:mod:`megalite.moe.fp8_experts`), whose amaxes over a contraction split by
    expert tensor parallelism are reduced over ``etp_group``; ``fp8_weights`` (an
    :class:`~megalite.moe.fp8_experts.Fp8ExpertWeights`) keeps the weights' quantisations
    for the training step.
    """
    num_experts, h = fc1.shape[0], x.shape[-1]
    index, cap = padded_index(tokens_per_expert)
    index = index.to(x.device)
    padded = x.new_zeros(num_experts * cap, h).index_copy(0, index, x)
    split = etp_group is not None and etp_group.size > 1

    def gemm(a, w, split_in: bool, split_out: bool, name: str):
        if fp8 is None:
            return _bmm(a, w)
        return fp8_expert_bmm(a, w, fp8, split_in=split_in, split_out=split_out,
                              etp_group=etp_group, weights=fp8_weights, name=name)

    hidden = gemm(padded.view(num_experts, cap, h), fc1, False, split, "fc1")  # [E_l, C, f1]
    if fc1_bias is not None:
        hidden = hidden + fc1_bias.unsqueeze(1)
    hidden = activation(hidden, swiglu)
    out = gemm(hidden, fc2, split, False, "fc2")  # [E_l, C, h]
    if fc2_bias is not None:
        out = out + fc2_bias.unsqueeze(1)
    return out.reshape(num_experts * cap, out.shape[-1]).index_select(0, index)


class GroupedMLP(torch.nn.Module):
    """This rank's ``E_l`` experts: expert-sorted tokens ``[M, h]`` -> ``[M, h]``.

    ``first_expert`` is the global index of local expert 0; the weights are split over
    ``ps.etp``. With etp > 1 the output is this rank's partial sum (see module docstring).
    """

    def __init__(self, cfg, num_local_experts: int, first_expert: int, ps, *,
                 fp8=None, device=None, dtype=None):
        super().__init__()
        self.ps = ps
        self.fp8 = fp8   # an Fp8Recipe: the grouped GEMMs in fp8 (megalite.moe.fp8_experts)
        # the weights' fp8 quantisations kept through a training step (no parameters)
        self.fp8_weights = None if fp8 is None else Fp8ExpertWeights()
        etp_group = ps.etp
        etp = etp_group.size
        h, ffn = cfg.hidden_size, cfg.moe_ffn_hidden_size
        self.swiglu = cfg.swiglu
        self.first_expert = first_expert
        self.etp_group = etp_group
        parts = (ffn, ffn) if cfg.swiglu else None
        fc1_out = (2 if cfg.swiglu else 1) * ffn // etp
        kw = {"device": ps.device if device is None else device, "dtype": dtype}
        mark = {"expert": True, "first_expert": first_expert}
        std = cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled output init
        split = etp > 1
        # marked as sharded over etp even at etp = 1 (as dense layers are at tp = 1), so
        # a checkpoint stores fc1's gate|up parts apart whatever etp it was saved at
        self.fc1 = mark_param(
            torch.nn.Parameter(torch.empty(num_local_experts, h, fc1_out, **kw)),
            partition_dim=2, parts=parts, init_std=std, **mark)
        self.fc2 = mark_param(
            torch.nn.Parameter(torch.empty(num_local_experts, ffn // etp, h, **kw)),
            partition_dim=1, init_std=out_std, **mark)
        self.fc1_bias = self.fc2_bias = None
        if cfg.add_bias_linear:
            self.fc1_bias = mark_param(
                torch.nn.Parameter(torch.empty(num_local_experts, fc1_out, **kw)),
                partition_dim=1, parts=parts, init_fill=0.0, **mark)
            self.fc2_bias = mark_param(
                torch.nn.Parameter(torch.empty(num_local_experts, h, **kw)), init_fill=0.0,
                sequence_parallel=split, **mark)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        fc2_bias = self.fc2_bias if self.etp_group.rank == 0 else None
        return grouped_mlp(x, tokens_per_expert, self.fc1, self.fc2, swiglu=self.swiglu,
                           fc1_bias=self.fc1_bias, fc2_bias=fc2_bias, fp8=self.fp8,
                           etp_group=self.etp_group, fp8_weights=self.fp8_weights)

    def reset_parameters(self, seed: int, prefix: str) -> None:
        """Draw each local expert's full weight from (seed, ``{prefix}.{param}.{expert}``)
        with its *global* expert index, then keep this etp rank's shard: the same experts
        whatever ep and etp (see ``layers.sharding.initialize_params``)."""
        for param in self.parameters(recurse=False):
            update_meta(param, initialized=False, init_name=None)
        initialize_params(self, seed, self.ps, prefix=prefix)


# -- full (layout-invariant) expert tensors ----------------------------------------------
def gather_expert_full(local: torch.Tensor, param: torch.Tensor, ps) -> torch.Tensor:
    """All experts' full tensor ``[E, ...]`` of the expert parameter ``param`` from this
    rank's ``local`` (``param`` itself or its grad, ``[E_l, ...]``): all-gather the etp
    shards (collective over ``ps.etp``), then the expert slices along dim 0
    (collective over ``ps.ep``)."""
    full = gather_full(local, param, ps.etp)
    ep = ps.ep
    if ep.size == 1:
        return full
    return torch.cat(all_gather_list(full, ep), dim=0)


def shard_expert_full(full: torch.Tensor, param: torch.Tensor, ps) -> torch.Tensor:
    """This rank's piece of an all-experts full tensor ``[E, ...]`` (the inverse of
    :func:`gather_expert_full`): experts ``ep_rank * E_l ...`` and this etp rank's shard."""
    num_local = param.shape[0]
    mine = full.narrow(0, ps.ep.rank * num_local, num_local)
    return shard(mine, param, ps.etp.size, ps.etp.rank)
