"""Muon's batched Newton-Schulz (:func:`megalite.optim.muon_layout.orthogonalize_batched`):
the matrices a rank orthogonalises whole are iterated in stacks of equal part shapes, and
on the CPU every result is bitwise the one-matrix-at-a-time result
(:func:`orthogonalize_full` below), for a model's worth of shapes:
a Llama-style GQA MoE model (Q, K, V apart with --muon-split-qkv, SwiGLU, expert stacks
``[E, in, out]``, the first layer dense) and a GPT-style one (the tall ``fc1 [4h, h]``
iterated on its small side without a transpose), under each scale mode; one ``orthogonalize_stack``
call per shape group, more when :data:`MUON_BATCH_BYTES` cuts a group, a part above it
alone."""

import pytest
import torch

from megalite.models.gpt import GPTModel
from megalite.optim import muon_layout
from megalite.optim.algorithms.muon import is_matrix
from megalite.optim.muon_layout import Matrix, _scaled, matrices, orthogonalize_local
from megalite.optim.newton_schulz import orthogonalize
from megalite.parallel.params import mark_param
from megalite.parallel.state import ParallelState
from tests.training.common import tiny_config

LLAMA_MOE = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176,
             "num_attention_heads": 4, "normalization": "RMSNorm", "swiglu": True,
             "position_embedding_type": "rope", "add_bias_linear": False,
             "group_query_attention": True, "num_query_groups": 2, "num_experts": 4,
             "moe_layer_freq": "[0,1]"}
GPT = {"num_layers": 1, "hidden_size": 48, "num_attention_heads": 4}


def orthogonalize_full(full: torch.Tensor, mat: Matrix, ocfg, parts=None) -> torch.Tensor:
    """The definition the batches must equal: ``full`` (a matrix or an ``[E, a, b]``
    stack) orthogonalised one matrix at a time, part by part along dimension 0 when
    ``parts`` (sizes) is given, each scaled for its shape."""
    steps, kind = ocfg.muon_num_ns_steps, ocfg.muon_coefficient_type
    prec = ocfg.muon_fp32_matmul_prec
    return torch.cat([_scaled(orthogonalize(x, steps, kind, prec), x.shape, mat.expert, ocfg)
                      for x in full.float().split(list(parts or [full.shape[0]]), dim=0)])


def _pairs(optim: dict):
    """``[(Matrix, U)]`` of both models' Muon matrices (random ``U``), and the config."""
    out, ocfg = [], None
    gen = torch.Generator().manual_seed(3)
    for model in (LLAMA_MOE, GPT):
        cfg = tiny_config(1, model=model, optim={"optimizer": "muon", **optim})
        ocfg = cfg.optim
        ps = ParallelState.build(cfg.parallel)
        named = [(n, p) for n, p in GPTModel(cfg.model, ps).named_parameters()
                 if is_matrix(n, p)]
        out += [(m, torch.randn(p.shape, generator=gen))
                for m, (_, p) in zip(matrices(named, ps, ocfg), named)]
    return out, ocfg


def _parts(pairs):
    """Shape ``(m, n)`` and matrix count of every part iterated."""
    out = []
    for mat, u in pairs:
        for x in u.split(list(mat.parts), dim=0) if mat.parts else [u]:
            out.append((tuple(x.shape[-2:]), x.shape[0] if x.dim() == 3 else 1))
    return out


@pytest.fixture
def calls(monkeypatch):
    """The stacks ``[B, m, n]`` each batched ``orthogonalize_stack`` call iterated."""
    seen = []
    real = muon_layout.orthogonalize_stack

    def counting(views, *args, **kwargs):
        seen.append((sum(v.shape[0] for v in views), *views[0].shape[-2:]))
        return real(views, *args, **kwargs)

    monkeypatch.setattr(muon_layout, "orthogonalize_stack", counting)
    return seen


@pytest.mark.parametrize("optim", [
    {},
    {"muon_scale_mode": "unit_rms_norm", "muon_extra_scale_factor": 0.2},
    {"muon_scale_mode": "shape_scaling", "muon_split_qkv": False,
     "muon_coefficient_type": "polar_express", "muon_num_ns_steps": 8},
], ids=["spectral-split", "unit_rms", "shape-unsplit-polar"])
def test_batched_equals_one_matrix_at_a_time_bitwise(optim, calls):
    pairs, ocfg = _pairs(optim)
    want = [orthogonalize_full(u, mat, ocfg, mat.parts) for mat, u in pairs]
    got = orthogonalize_local(pairs, ocfg)
    for (mat, _), w, g in zip(pairs, want, got):
        assert g.shape == w.shape and torch.equal(g, w), mat.name
    shapes = _parts(pairs)
    groups = {s for s, _ in shapes}
    # every group in one call (all of them fit the default bound), far fewer than parts
    assert sorted(calls) == sorted((sum(k for s2, k in shapes if s2 == s), *s)
                                   for s in groups)
    assert len(calls) == len(groups) < len(shapes)
    # the models' shapes do meet: Q and proj [64, 64]; K and V [32, 64] (split); dense and
    # expert SwiGLU fc1 [64, 352] (dense [352, 64] transposed); GPT's fc1 [192, 48] and fc2
    # [48, 192]
    if ocfg.muon_split_qkv:
        assert ((32, 64), 1) in shapes and ((64, 64), 1) in shapes
    assert ((48, 192), 1) in shapes and ((64, 352), 4) in shapes


def test_the_byte_bound_cuts_a_group_and_a_large_part_runs_alone(monkeypatch, calls):
    pairs, ocfg = _pairs({})
    want = [orthogonalize_full(u, mat, ocfg, mat.parts) for mat, u in pairs]
    # room for two [64, 64] matrices: Q, proj (x 2 layers) in two batches of two; the
    # expert stacks [4, 64, 352] and [4, 176, 64] exceed it and run alone, as does a
    # dense fc1 [352, 64] (tall: iterated on its small side as it is)
    monkeypatch.setattr(muon_layout, "MUON_BATCH_BYTES", 2 * 64 * 64 * 4)
    got = orthogonalize_local(pairs, ocfg)
    for (mat, _), w, g in zip(pairs, want, got):
        assert torch.equal(g, w), mat.name
    assert calls.count((2, 64, 64)) == 2 and (4, 64, 64) not in calls
    assert (4, 64, 352) in calls and (1, 352, 64) in calls
    assert all(b * m * n * 4 <= 2 * 64 * 64 * 4 or b == 1 or (b, m, n) in
               {(4, 64, 352), (4, 176, 64)} for b, m, n in calls)
    assert len(calls) > len({s for s, _ in _parts(pairs)})


def test_batches_keep_order_and_bound():
    """``_batches`` cuts in list order, never above the bound unless a member alone is."""
    bound = muon_layout.MUON_BATCH_BYTES
    sizes = [bound // 2, bound // 2, bound // 4, 2 * bound, bound // 4, bound]
    cut = muon_layout._batches(list(range(6)), sizes)
    assert cut == [[0, 1], [2], [3], [4], [5]]


def test_large_parts_bitwise():
    """Parts large enough that the CPU splits a reduction's work by the batch's size (the
    squared norm is taken as row sums, then their sum, to stay exact): four ``[256,
    2048]`` matrices iterated together, a tall ``[2048, 256]`` one and a 2-expert stack
    ``[2, 2048, 256]`` iterated in the tall form."""
    cfg = tiny_config(1, optim={"optimizer": "muon"})
    gen = torch.Generator().manual_seed(5)
    shapes = [(256, 2048)] * 3 + [(2048, 256), (256, 2048)]
    pairs = [(Matrix(f"m{i}", torch.zeros(s), None, None), torch.randn(s, generator=gen))
             for i, s in enumerate(shapes)]
    stack = mark_param(torch.nn.Parameter(torch.zeros(2, 2048, 256)), init_std=0.02,
                       expert=True)
    pairs.append((Matrix("experts", stack, None, None), torch.randn(2, 2048, 256,
                                                                  generator=gen)))
    want = [orthogonalize_full(u, mat, cfg.optim) for mat, u in pairs]
    got = orthogonalize_local(pairs, cfg.optim)
    for (mat, _), w, g in zip(pairs, want, got):
        assert torch.equal(g, w), mat.name
