"""End-to-end training equivalence of a tiny Mixtral: ep x tp(+SP) x dispatcher, plus one
row with the distributed optimizer, one with pp 2 x vpp 2 (4 layers, MoE every other) and
two under the zero-bubble schedule (the experts' weight gradients in W steps); and
DeepSeek-V3 routing (sigmoid, group-limited, the expert bias updated every step, the
first layer dense) at ep 2, ep 2 x tp 2 + SP, pp 2 and the distributed optimizer, whose
per-layer expert loads (``expert_load``) must equal the single-process run's too; and
Qwen3-MoE's shape (QK norm, softmax before the top-k without renormalizing, a dense first
layer wider than the experts) at ep 2 x tp 2 + SP and ep 2 x pp 2; and DeepSeek-V2
routing (softmax before a group-limited top-3, scaled, a shared expert, multi-latent
attention, a dense first layer) at ep 2 and ep 2 x tp 2 + SP.

Every layout trains the same model (fp32, dropout 0, dropless, aux loss 0.01, z loss
0.001) on the same mock data for ``ITERS`` iterations through the real loop
(``tests/training/common.run_training``), and must reproduce the single-process run:

* per iteration: ``lm_loss``, ``moe_aux_loss``, ``moe_z_loss`` (means over the global
  batch, every MoE layer) and ``grad_norm`` (expert gradients counted once over etp, ep and
  edp) from the metrics JSONL;
* the final parameters, gathered to full tensors (experts over etp and ep).

The aux-loss gradient factor ``1 / (num_microbatches * dp)`` is checked absolutely on one
process (:func:`test_router_loss_gradient_scale`): at dp > 1 a wrong factor would show up
as a parameter mismatch against the dp = 1 reference.
"""

import os
import types

import pytest
import torch

from megalite.config import ParallelConfig
from megalite.models.gpt import GPTModel
from megalite.moe.layer import moe_layers, set_aux_loss_scale
from megalite.parallel.state import ParallelState
from megalite.pipeline.layout import model_chunks
from megalite.training.forward_backward import RouterLosses, forward_backward
from tests.layouts import Layout, layouts, run_by_world, tiny
from tests.training.common import read_jsonl, run_training

ITERS = 4
LOSS_TOL = 2e-5     # absolute, lm_loss (about 4.1)
AUX_RTOL = 1e-5     # relative, moe_aux_loss (about 0.01) and moe_z_loss (about 0.002)
NORM_RTOL = 1e-4    # relative, grad_norm (about 1)
PARAM_TOL = 5e-5    # absolute, every parameter after ITERS Adam steps at lr 3e-3

MIXTRAL = {"num_layers": 2, "normalization": "RMSNorm", "swiglu": True,
           "position_embedding_type": "rope", "add_bias_linear": False,
           "untie_embeddings_and_output_weights": True, "group_query_attention": True,
           "num_query_groups": 2, "ffn_hidden_size": 64, "num_experts": 4,
           "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
# ep x tp(+SP) x etp x dispatcher, the distributed optimizer (expert shards over edp), and
# pp 2 x vpp 2 with 4 layers, MoE every other one (the second stage holds no MoE layer)
LAYOUTS = layouts("moe-training")


def _cfg(layout, jsonl, world=None):
    return tiny(layout, world, model=MIXTRAL, train={"train_iters": ITERS},
                logging={"metrics_jsonl": jsonl})


def _train(rank, world_size, layouts, directory):
    out = []
    for layout in layouts:
        jsonl = os.path.join(directory, f"{layout.name}.jsonl")
        _, c = run_training(_cfg(layout, jsonl))
        params = {}
        for chunk in model_chunks(c.model):
            params.update(chunk.full_state_dict())  # collective over tp, etp and ep
        out.append(params)
    return out


def _reference_model(layout):
    """The model of the single-process reference: the dispatcher only moves tokens
    between ranks, and --moe-shared-expert-overlap only runs the shared experts earlier,
    so one reference serves each."""
    return {k: v for k, v in layout.model.items()
            if k not in ("moe_token_dispatcher_type", "moe_shared_expert_overlap")}


def _reference_key(layout) -> str:
    """The reference a row compares with: its model (:func:`_reference_model`) and its
    train overrides (a micro-batch size changes the per-micro-batch router losses)."""
    return repr((sorted(_reference_model(layout).items()), sorted(layout.train.items())))


def _reference(directory, model, train=None):
    jsonl = os.path.join(directory, "reference.jsonl")
    _, c = run_training(_cfg(Layout("reference", 1, model=model, train=dict(train or {})),
                             jsonl))
    return read_jsonl(jsonl), c.model.full_state_dict()


def _check_rows(rows, ref_rows, what):
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1)), what
    for row, ref in zip(rows, ref_rows):
        it = row["iteration"]
        assert abs(row["lm_loss"] - ref["lm_loss"]) < LOSS_TOL, (what, it, row, ref)
        for key in ("moe_aux_loss", "moe_z_loss"):
            assert row[key] == pytest.approx(ref[key], rel=AUX_RTOL), (what, it, key)
        # the expert bias: the load of the global batch, counted the same at any layout
        assert row.get("expert_load") == ref.get("expert_load"), (what, it)
        # multi-token prediction: each depth's loss (token mean over the global batch)
        mtp = sorted(k for k in ref if k.startswith("mtp_"))
        assert sorted(k for k in row if k.startswith("mtp_")) == mtp, (what, it)
        for key in mtp:
            assert abs(row[key] - ref[key]) < LOSS_TOL, (what, it, key, row[key], ref[key])
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=NORM_RTOL), (what, it)


def _check_params(rank_params, ref_params, what):
    seen = set()
    for params in rank_params:
        for name, tensor in params.items():
            seen.add(name)
            torch.testing.assert_close(tensor, ref_params[name], rtol=0, atol=PARAM_TOL,
                                       msg=lambda m, name=name: f"{what} {name}: {m}")
    assert seen == set(ref_params), (what, set(ref_params) - seen)


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_training")


@pytest.fixture(scope="module")
def references(directory):
    """Single-process metrics rows and full parameters, by reference model."""
    refs = {}
    for layout in LAYOUTS:
        key = _reference_key(layout)
        if key not in refs:
            refs[key] = _reference(str(directory / f"ref{len(refs)}"), _reference_model(layout),
                                   layout.train)
            rows = refs[key][0]
            assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
            assert all(r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 for r in rows)
    return refs


@pytest.fixture(scope="module")
def trained(directory):
    return run_by_world(LAYOUTS, _train, str(directory), timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_mixtral_training_matches_single_process(directory, references, trained, layout):
    ref_rows, ref_params = references[_reference_key(layout)]
    params = trained(layout)
    rows = read_jsonl(str(directory / f"{layout.name}.jsonl"))
    _check_rows(rows, ref_rows, layout.name)
    _check_params(params, ref_params, layout.name)


# -- the router-loss gradient factor, on one process ---------------------------------------
def _batches(cfg, num, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
        mask = (torch.rand(2, cfg.seq_length, generator=g) > 0.2).float()
        out.append({"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask})
    return out


def test_router_loss_gradient_scale():
    """forward_backward's gradients equal those of ``sum_mb lm_sum / tokens +
    mean_mb (sum of every layer's aux + z loss)``, times the loss scale."""
    cfg = _cfg(Layout("reference", 1), None)
    ps = ParallelState.build(ParallelConfig())
    batches = _batches(cfg.model, 3)
    tokens = sum(b["loss_mask"].sum() for b in batches).double()
    fp16_scale = 4.0

    model = GPTModel(cfg.model, ps, seed=3)
    router = RouterLosses(ps.device)
    c = types.SimpleNamespace(cfg=cfg, ps=ps, model=model, layout=cfg.resolve(1))
    forward_backward(c, batches, tokens, loss_scale=lambda x: x * fp16_scale,
                     router_losses=router)
    assert all(layer.aux_loss_scale == fp16_scale / 3 for layer in moe_layers(model))

    ref = GPTModel(cfg.model, ps, seed=3)
    set_aux_loss_scale(ref, 0.0)  # the router losses enter through `total` below instead
    captured = []
    for layer in moe_layers(ref):
        layer.router.register_forward_hook(lambda m, i, out: captured.append(out.loss))
    total, aux_values = 0.0, []
    for b in batches:
        captured.clear()
        per_token = ref(b["tokens"], labels=b["labels"])
        total = total + (per_token * b["loss_mask"]).sum() / tokens.float()
        total = total + sum(captured) / len(batches)
        aux_values.append(sum(float(x.detach()) for x in captured))
    (total * fp16_scale).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    means = router.means()
    assert means["moe_aux_loss"] + means["moe_z_loss"] == pytest.approx(
        sum(aux_values) / (len(batches) * len(moe_layers(ref))), rel=1e-6)
