"""Multi-token prediction (``--mtp-num-layers``, ``megalite.transformer.mtp``) on one
process: each depth's per-token loss against a reference written from the definition
(DeepSeek-V3: norms of the shifted token embedding and of the previous depth's hidden
state, concatenated and projected, one layer, the final norm, the shared output layer;
labels shifted as far), the objective forward_backward differentiates, the logged means,
the roll, the parameter and FLOP counts, and the config's refusals. The layouts (tp + sp,
cp with each comm type, pp / vpp, ep, the distributed optimizer, ZeRO-3, recomputation)
are rows of ``tests/layouts.py``."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

from megalite.config import ConfigError, MegaliteConfig, ParallelConfig, TrainConfig
from megalite.config import shapes
from megalite.models.gpt import GPTModel
from megalite.parallel.state import ParallelState
from megalite.training.forward_backward import MTPLosses, forward_backward
from megalite.transformer.mtp import roll_for_mtp, roll_left
from tests.model.common import batch, deepseek_v3_config, gpt2_config, llama_config


def _norm(norm: torch.nn.Module, x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    if kind == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, eps)


def _reference_losses(model: GPTModel, ids: torch.Tensor, labels: torch.Tensor,
                      depths: int) -> list[torch.Tensor]:
    """Each depth's per-token loss ``[b, s]`` from the definition, with the model's weights
    (the transformer layers are run as modules: they are tested on their own)."""
    cfg = model.config
    captured = []
    hook = model.decoder.register_forward_hook(lambda m, i, out: captured.append(out))
    model(ids, labels=labels)
    hook.remove()
    hidden = captured[0]                            # [s, b, h], after the final norm
    table = model.embedding.word_embeddings.weight
    out_w = model.output_weight()
    s = ids.shape[1]
    pos = torch.arange(s).unsqueeze(1)
    rotary = None if model.rotary is None else model.rotary(pos)
    losses = []
    for k, depth in enumerate(model.mtp.layers, start=1):
        shifted = torch.zeros_like(ids)
        shifted[:, :s - k] = ids[:, k:]            # position i sees token i + k
        target = torch.zeros_like(labels)
        target[:, :s - k] = labels[:, k:]
        e = F.embedding(shifted.t(), table)
        if model.embedding.position_embeddings is not None:
            e = e + model.embedding.position_embeddings.weight[:s].unsqueeze(1)
        x = torch.cat([_norm(depth.enorm, e, cfg.normalization, cfg.norm_epsilon),
                       _norm(depth.hnorm, hidden, cfg.normalization, cfg.norm_epsilon)], -1)
        x = x @ depth.eh_proj.weight.t()
        x = depth.transformer_layer(x, rotary)
        hidden = _norm(depth.final_layernorm, x, cfg.normalization, cfg.norm_epsilon)
        logits = (hidden @ out_w.t())[..., :cfg.vocab_size].float()
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), target.t().reshape(-1),
                               reduction="none", ignore_index=-100)
        losses.append(loss.view(s, -1).t())
    return losses


@pytest.mark.parametrize("make", [
    lambda: gpt2_config(mtp_num_layers=2),
    lambda: llama_config(mtp_num_layers=2),
    lambda: deepseek_v3_config(mtp_num_layers=1)], ids=["gpt2", "llama", "deepseek-v3"])
def test_depth_losses_match_the_definition(make):
    cfg = make()
    ps = ParallelState.build(ParallelConfig())
    model = GPTModel(cfg, ps, seed=5)
    ids, labels = batch(cfg)
    rolled = roll_for_mtp({"tokens": ids, "labels": labels,
                           "loss_mask": torch.ones_like(ids)}, cfg.mtp_num_layers)
    main = model(ids, labels=labels, mtp_tokens=rolled["mtp_tokens"],
                 mtp_labels=rolled["mtp_labels"])
    got = model.mtp_losses
    torch.testing.assert_close(main, model(ids, labels=labels))   # MTP leaves it alone
    want = _reference_losses(model, ids, labels, cfg.mtp_num_layers)
    assert len(got) == len(want) == cfg.mtp_num_layers
    for k, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"depth {k + 1}")
    # the last layer's kind: DeepSeek-V3's depth is an MoE layer like its layer 1
    assert model.mtp.layers[0].transformer_layer.is_moe == cfg.moe_layer_pattern[-1]
    model(ids, labels=labels)   # without the rolled entries: no depth runs
    assert model.mtp_losses is None


def test_roll_shifts_left_and_masks_the_end():
    x = torch.arange(1, 7).view(1, 6)
    assert roll_left(x, 2).tolist() == [[3, 4, 5, 6, 0, 0]]
    assert roll_left(x, 6).tolist() == [[0] * 6]
    b = {"tokens": x, "labels": x + 10, "loss_mask": torch.ones(1, 6)}
    out = roll_for_mtp(b, 2)
    assert out["mtp_tokens"].shape == (2, 1, 6)
    assert out["mtp_labels"][1].tolist() == [[13, 14, 15, 16, 0, 0]]
    assert out["mtp_loss_mask"][0].tolist() == [[1, 1, 1, 1, 1, 0]]
    assert roll_for_mtp(b, 0) is b


@pytest.mark.parametrize("per_microbatch", [False, True], ids=["global-tokens",
                                                              "per-microbatch"])
def test_objective_adds_the_scaled_mean_of_the_depths(per_microbatch):
    """forward_backward's gradients are those of ``(sum lm m + (0.3 / 2) sum_k sum l_k m_k)
    / tokens`` summed over micro-batches (``--per-microbatch-loss``: each micro-batch's LM
    mean, and each depth's mean over its rolled mask, over the 2 micro-batches, as
    Megatron-Core); MTPLosses logs each depth's token mean."""
    from megalite.training.forward_backward import loss_divisors, mtp_loss_divisors
    from tests.training.common import tiny_config

    cfg = tiny_config(model={"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3,
                             "position_embedding_type": "rope"})
    cfg.model.vocab_size = 61
    ps = ParallelState.build(ParallelConfig())
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 61, (2, cfg.model.seq_length + 1), generator=g)
        mask = (torch.rand(2, cfg.model.seq_length, generator=g) > 0.2).float()
        batches.append(roll_for_mtp({"tokens": ids[:, :-1], "labels": ids[:, 1:],
                                     "loss_mask": mask}, 2))
    tokens = sum(b["loss_mask"].sum() for b in batches).double()
    model = GPTModel(cfg.model, ps, seed=3)
    logged = MTPLosses(2, ps.device)
    c = types.SimpleNamespace(cfg=cfg, ps=ps, model=model, layout=cfg.resolve(1))
    if per_microbatch:
        forward_backward(c, batches, loss_divisors(batches, tokens, True, 1),
                         mtp_losses=logged, mtp_divisors=mtp_loss_divisors(batches, 1))
    else:
        forward_backward(c, batches, tokens, mtp_losses=logged)

    ref = GPTModel(cfg.model, ps, seed=3)
    total, sums, counts = 0.0, [0.0, 0.0], [0.0, 0.0]
    for b in batches:
        main = ref(b["tokens"], labels=b["labels"], mtp_tokens=b["mtp_tokens"],
                   mtp_labels=b["mtp_labels"])
        lm_div = b["loss_mask"].sum() * 2 if per_microbatch else tokens.float()
        total = total + (main * b["loss_mask"]).sum() / lm_div
        for k, loss in enumerate(ref.mtp_losses):
            masked = (loss * b["mtp_loss_mask"][k]).sum()
            div = b["mtp_loss_mask"][k].sum() * 2 if per_microbatch else tokens.float()
            total = total + 0.3 / 2 * masked / div
            sums[k] += float(masked.detach())
            counts[k] += float(b["mtp_loss_mask"][k].sum())
    total.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert ref.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0
    means = logged.means()
    assert means == pytest.approx({"mtp_1_loss": sums[0] / counts[0],
                                   "mtp_2_loss": sums[1] / counts[1]}, rel=1e-6)


@pytest.mark.parametrize("make", [
    lambda: gpt2_config(mtp_num_layers=2),
    lambda: deepseek_v3_config(mtp_num_layers=1)], ids=["gpt2", "deepseek-v3"])
def test_parameter_and_flop_counts(make):
    cfg = make()
    model = GPTModel(cfg, ParallelState.build(ParallelConfig()))
    built = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert built == cfg.mtp_num_layers * sum(shapes.mtp_depth_params(cfg))
    v = cfg.padded_vocab_size(1)
    plain = dataclasses.replace(cfg, mtp_num_layers=None)
    d_qk, d_v = shapes.attention_head_dims(cfg)
    dense, experts = shapes.mtp_depth_params(cfg)
    active = dense + (experts // cfg.num_experts * cfg.moe_router_topk if experts else 0)
    extra = cfg.mtp_num_layers * (6 * active + 6 * cfg.hidden_size * v + 6 * cfg.seq_length
                                  * cfg.num_attention_heads * (d_qk + d_v))
    assert shapes.flops_per_token(cfg, v) == pytest.approx(
        shapes.flops_per_token(plain, v) + extra, rel=1e-12)




def test_config_refusals():
    with pytest.raises(ConfigError, match="--mtp-num-layers must be >= 0"):
        gpt2_config(mtp_num_layers=-1)
    with pytest.raises(ConfigError, match="--mtp-loss-scaling-factor"):
        gpt2_config(mtp_num_layers=1, mtp_loss_scaling_factor=float("nan"))
    learned = MegaliteConfig(model=gpt2_config(mtp_num_layers=1),
                             parallel=ParallelConfig(pipeline_model_parallel_size=2))
    with pytest.raises(ConfigError, match="learned absolute position"):
        learned.validate(2)
    MegaliteConfig(model=gpt2_config(mtp_num_layers=1)).validate(1)   # one stage: fine
    for schedule in ("zbv", "dualpipev"):   # the V schedules: depths on rank 0's chunk 1
        v_shape = MegaliteConfig(
            model=gpt2_config(mtp_num_layers=1, position_embedding_type="rope", num_layers=4),
            parallel=ParallelConfig(pipeline_model_parallel_size=2, pipeline_schedule=schedule),
            train=TrainConfig(micro_batch_size=1, global_batch_size=4))
        v_shape.validate(2)
        v_shape.model.position_embedding_type = "learned_absolute"   # still no table copy
        with pytest.raises(ConfigError, match="output layer's model chunk would need a copy"):
            v_shape.validate(2)
    # a last stage without decoder layers cannot be asked for
    with pytest.raises(ConfigError, match="decoder_last_pipeline_num_layers"):
        ParallelConfig(pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=0)


def test_formats_without_depths_say_so():
    """Megatron checkpoints carry the depths (tests/checkpoint/test_megatron_*), but not
    with learned absolute positions, which Megatron-LM does not build; a Hugging Face
    family without a place for them warns on export."""
    from megalite.checkpoint.megatron.arguments import megatron_args, unexportable, unsupported
    from megalite.models.families import get_family

    model = llama_config(mtp_num_layers=1)
    assert unsupported(megatron_args(MegaliteConfig(model=model))) == []
    assert unexportable(model) == []
    (problem,) = unexportable(gpt2_config(mtp_num_layers=1))
    assert "with learned absolute position embeddings" in problem
    (warning,) = get_family("llama").export_warnings(model)
    assert "1 multi-token prediction depth(s)" in warning
    assert get_family("llama").export_warnings(llama_config()) == []
