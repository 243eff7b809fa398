"""What ``--optimizer muon`` adds to a step: the Newton-Schulz iterations over its matrices
(:mod:`megalite.optim.muon_layout`) and the exchanges that bring each whole matrix to the
rank that orthogonalises it.

The matrices (:func:`layer_matrices`, full shapes at tp 1, as
:meth:`megalite.optim.muon_layout.Matrix.cost` counts them): attention's Q, K and V apart
under ``--muon-split-qkv`` (one ``[(nh + 2 ng) d, h]`` matrix without) and its output
projection, or multi-latent attention's projections (the down projections whole on every
tp rank); a dense MLP's fc1 (``[2f, h]`` under SwiGLU: one matrix) and fc2; an MoE layer's
expert stacks ``[E/ep, h, 2f]`` and ``[E/ep, f, h]`` over ``etp`` and its shared expert's;
each multi-token prediction depth's ``eh_proj`` and layer. Not the embedding, the output
layer, the router, norms or biases (the scalar optimizer's).

Per rank and step:

* **FLOPs** -- :func:`megalite.optim.newton_schulz.ns_flops` of each matrix, by
  ``--muon-tp-mode``: ``duplicated``, the whole matrix on one owner rank of its tp group;
  ``distributed``, each tp rank its ``1/tp`` of the split side, ``steps (4 m^2 n / tp + 2
  m^3)`` with ``m`` the unsplit side; ``blockwise``, each shard on its own. A matrix not
  split over tp runs whole on every tp rank. With the distributed optimizer or ZeRO each
  whole matrix has one owner rank in dp x cp (experts: edp); without, every replica
  iterates every matrix. Owners are balanced by FLOPs, so a rank's share is the total over
  its owners, but never less than the largest single matrix. The busiest pipeline stage
  counts (the last, which holds the prediction depths).
* **element-wise passes** -- the momentum, normalisation, result and update passes over
  the matrices (:func:`elementwise_bytes`: 74 bytes an element with Nesterov and bf16,
  62 without) replace the ``16 + 2 x dtype`` bytes every parameter is charged at
  ``Cluster.memory_rate`` (:func:`megalite.planner.time.optimizer_seconds`). At the 1.1B
  shape of ``tools/benchmark.py gpu`` (0.97 billion matrix elements) that traffic is 13
  ms at an H200's full 4.8 TB/s (43 ms at the presets' 0.3 of it), where a profile there
  measured about 30 ms of such passes before a copy of the momentum and the strided
  reads of the tall matrices were removed.
* **rate** -- on a GPU ``--muon-fp32-matmul-prec medium`` / ``low`` iterate in bf16 at
  ``peak_flops``, ``high`` in TF32 at half of it; a CPU cluster (no ``fp32_flops``) runs
  IEEE fp32 at ``peak_flops``; times ``matmul_efficiency``.
* **bytes** -- ``duplicated`` at tp > 1: each split matrix's shards to its owner and the
  result back, ``2 x 4 T (tp - 1) / tp`` for this rank's split Muon elements ``T`` (on
  one dp owner only under the distributed optimizer: ``/ D``); ``distributed``: each
  iteration step's Gram matrix ``[m, m]`` all-reduced in fp32 over tp; the distributed
  optimizer's owner exchange: every piece to its owner and back, ``2 x 4 M (D - 1) /
  D^2`` for this rank's Muon elements ``M`` (pieces spread evenly over the shards; the
  contiguous buckets make it less, ``tools/benchmark.py optimizer``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.shapes import is_moe_layer, mtp_depths
from megalite.optim.newton_schulz import ns_flops
from megalite.planner.schedule import output_stage, stage_layers


@dataclass(frozen=True)
class MatrixShape:
    """``count`` matrices ``[rows, cols]`` (full, tp 1) whose ``split`` side (``"rows"``,
    ``"cols"`` or None: whole on every tp rank) is cut over tp, or over etp for experts."""

    count: int
    rows: int
    cols: int
    split: str | None
    expert: bool = False

    def flops(self, steps: int) -> float:
        return self.count * ns_flops(self.rows, self.cols, steps)

    def local_elements(self, tp: int) -> int:
        """Elements one rank holds: its ``1/tp`` of a split matrix, the others whole."""
        whole = self.count * self.rows * self.cols
        return whole // tp if self.split is not None else whole


def _attention(m, split_qkv: bool) -> list[MatrixShape]:
    h, n = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        q_out = n * m.mla_q_head_dim
        if m.q_lora_rank is None:
            q = [MatrixShape(1, q_out, h, "rows")]
        else:
            q = [MatrixShape(1, m.q_lora_rank, h, None),
                 MatrixShape(1, q_out, m.q_lora_rank, "rows")]
        return [*q, MatrixShape(1, m.kv_lora_rank + m.qk_pos_emb_head_dim, h, None),
                MatrixShape(1, n * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank, "rows"),
                MatrixShape(1, h, n * m.v_head_dim, "cols")]
    d, g = m.kv_channels, m.num_query_groups
    qkv = ([MatrixShape(1, n * d, h, "rows"), MatrixShape(1, g * d, h, "rows"),
            MatrixShape(1, g * d, h, "rows")] if split_qkv
           else [MatrixShape(1, (n + 2 * g) * d, h, "rows")])
    return [*qkv, MatrixShape(1, h, n * d, "cols")]


def _mlp(m, ffn: int, experts: int = 0) -> list[MatrixShape]:
    h, fc1 = m.hidden_size, (2 if m.swiglu else 1) * ffn
    if experts:   # stacks [E, in, out]: fc1 split along out, fc2 along in
        return [MatrixShape(experts, h, fc1, "cols", True),
                MatrixShape(experts, ffn, h, "rows", True)]
    return [MatrixShape(1, fc1, h, "rows"), MatrixShape(1, h, ffn, "cols")]


def layer_matrices(m, layer: int, split_qkv: bool = True, ep: int = 1,
                   router: bool = False) -> list[MatrixShape]:
    """The Muon matrices of global decoder layer ``layer`` (an MoE layer's ``E / ep``
    local experts); with ``router`` also an MoE layer's router ``[E, h]`` (whole on every
    rank), which Lion steps and Muon does not."""
    out = _attention(m, split_qkv)
    if not is_moe_layer(m, layer):
        return out + _mlp(m, m.ffn_hidden_size)
    if router:
        out.append(MatrixShape(1, m.num_experts, m.hidden_size, None))
    out += _mlp(m, m.moe_ffn_hidden_size, m.num_experts // ep)
    if m.moe_shared_expert_intermediate_size:
        out += _mlp(m, m.moe_shared_expert_intermediate_size)
    return out


def mtp_matrices(m, split_qkv: bool = True, ep: int = 1,
                 router: bool = False) -> list[MatrixShape]:
    """Each multi-token prediction depth's ``eh_proj`` ``[h, 2h]`` and its layer (the kind
    of the last decoder layer), for every depth."""
    depth = [MatrixShape(1, m.hidden_size, 2 * m.hidden_size, "rows"),
             *layer_matrices(m, m.num_layers - 1, split_qkv, ep, router)]
    return depth * mtp_depths(m)


def _rank_flops(mat: MatrixShape, steps: int, mode: str, tp: int) -> tuple[float, int]:
    """(FLOPs one tp rank runs for ``mat``, ranks of the tp group its whole iteration is
    spread over as owners: ``tp`` under ``duplicated``, else 1)."""
    if mat.split is None or tp == 1:
        return mat.flops(steps), 1
    if mode == "duplicated":
        return mat.flops(steps), tp
    rows, cols = mat.rows, mat.cols
    if mode == "blockwise":
        rows, cols = (rows // tp, cols) if mat.split == "rows" else (rows, cols // tp)
        return mat.count * ns_flops(rows, cols, steps), 1
    kept, cut = (cols, rows) if mat.split == "rows" else (rows, cols)
    return mat.count * steps * (4.0 * kept * kept * cut / tp + 2.0 * kept ** 3), 1


def _stage_matrices(cfg, lay, stage: int, router: bool = False) -> list[MatrixShape]:
    """The Muon matrices pipeline rank ``stage`` holds (its layers; the prediction depths on
    the output stage), with ``router`` the routers too."""
    m, p, split_qkv = cfg.model, cfg.parallel, cfg.optim.muon_split_qkv
    out = [mat for layer in stage_layers(m, p, stage)
           for mat in layer_matrices(m, layer, split_qkv, lay.ep, router)]
    if stage == output_stage(p):
        out += mtp_matrices(m, split_qkv, lay.ep, router)
    return out


def _groups(cfg, lay, expert: bool) -> tuple[int, int]:
    """(ranks a matrix is split over: tp, etp for experts; its possible owners: dp x cp,
    edp for experts, under a sharded optimizer, else 1)."""
    owners = (lay.edp if expert else lay.dp * lay.cp) \
        if cfg.parallel.use_distributed_optimizer else 1
    return (lay.etp if expert else lay.tp), owners


def stage_elements(cfg, lay, stage: int, lion: bool = False) -> tuple[int, int]:
    """(dense, expert) elements of the Muon matrices one rank of pipeline rank ``stage``
    holds: its tp (experts: etp) shard of each split matrix, the others whole; with
    ``lion`` those of every weight ``--optimizer lion`` steps with Lion (the routers and
    learned position embeddings too)."""
    out = [0, 0]
    for mat in _stage_matrices(cfg, lay, stage, router=lion):
        out[1 if mat.expert else 0] += mat.local_elements(_groups(cfg, lay, mat.expert)[0])
    m = cfg.model
    if lion and stage == 0 and m.learned_positions:
        out[0] += m.max_position_embeddings * m.hidden_size
    return out[0], out[1]


def step_flops(cfg, lay) -> float:
    """Newton-Schulz FLOPs the busiest rank runs per optimizer step (module docstring);
    ``lay`` is ``cfg``'s resolved layout."""
    steps, mode = cfg.optim.muon_num_ns_steps, cfg.optim.muon_tp_mode
    busiest = 0.0
    for stage in range(lay.pp):
        mats = _stage_matrices(cfg, lay, stage)
        rank = 0.0
        for expert in (False, True):
            tp, owners = _groups(cfg, lay, expert)
            shares = [_rank_flops(mat, steps, mode, tp) for mat in mats if mat.expert == expert]
            if shares:
                spread = sum(f / k for f, k in shares) / owners
                rank += max(spread, max(f for f, _ in shares))
        busiest = max(busiest, rank)
    return busiest


def iteration_rate(precision: str, cluster) -> float:
    """FLOP/s of the iteration's matmuls at ``--muon-fp32-matmul-prec`` ``precision`` on
    ``cluster`` (module docstring)."""
    rate = cluster.peak_flops
    if cluster.fp32_flops and precision == "high":     # a GPU's TF32: half its bf16 rate
        rate /= 2
    return rate * cluster.matmul_efficiency


def elementwise_bytes(nesterov: bool, dtype_bytes: int) -> int:
    """Memory traffic per Muon matrix element per step outside the Newton-Schulz GEMMs
    (fp32 masters, gradients and momentum, the iteration in bf16), pass by pass
    (:meth:`megalite.optim.algorithms.muon.MuonOptimizer.step`): the momentum's lerp 12
    (reads M and G, writes M), Nesterov's 12 more (reads G and M, writes U), the
    normalisation into the iteration's stack 10 (the norm's read, the scaled read and a
    bf16 write), the result into the fp32 ``O`` 14 (copied from bf16, then scaled), the
    masters' weight decay 8 and update 12, the model's copy ``4 + dtype_bytes``."""
    return 12 + (12 if nesterov else 0) + 10 + 14 + 8 + 12 + 4 + dtype_bytes


def elementwise_elements(cfg, lay) -> float:
    """Muon matrix elements whose element-wise passes the busiest rank runs per step: its
    tp (etp) shards of its stage's matrices, divided over their owners under a sharded
    optimizer (each rank steps its shard of the momentum and the masters)."""
    busiest = 0.0
    for stage in range(lay.pp):
        dense, expert = stage_elements(cfg, lay, stage)
        busiest = max(busiest, dense / _groups(cfg, lay, False)[1]
                      + expert / _groups(cfg, lay, True)[1])
    return busiest


def step_bytes(cfg, lay) -> tuple[float, float]:
    """(tp bytes, dp bytes) the busiest rank sends per step for Muon's exchanges (module
    docstring)."""
    o = cfg.optim
    tp_bytes = dp_bytes = 0.0
    for stage in range(lay.pp):
        t = d = 0.0
        for mat in _stage_matrices(cfg, lay, stage):
            group, owners = _groups(cfg, lay, mat.expert)
            split = mat.split is not None and group > 1
            local = mat.local_elements(group)
            if split and o.muon_tp_mode == "duplicated":
                t += 2 * 4 * local * (group - 1) / group / owners
            elif split and o.muon_tp_mode == "distributed":
                kept = mat.cols if mat.split == "rows" else mat.rows
                t += mat.count * o.muon_num_ns_steps * 2 * 4 * kept * kept * (group - 1) / group
            if owners > 1:
                d += 2 * 4 * local * (owners - 1) / owners ** 2
        tp_bytes, dp_bytes = max(tp_bytes, t), max(dp_bytes, d)
    return tp_bytes, dp_bytes
