"""Random layouts for the layout fuzzer: one seed -> one :class:`tests.layouts.Layout`.

A draw picks a tiny model (GPT-2 or Llama style, 2-8 layers, hidden 32/64, 4 heads, GQA
with 1 or 2 groups or none, vocabulary 50/60 padded per tp, tied or untied embeddings,
recompute none/selective/full-uniform/full-block, dense or MoE with 4 experts top-2 and
either dispatcher, fp32 or bf16), AdamW, SGD, Muon or Lion with gradient clipping on or off, and a
layout of 1 to 8 ranks (tp 1/2/4 with or without sequence parallelism, pp 1/2/4 with
virtual stages or an uneven first/last stage, dp 1-4, ep and etp, the distributed
optimizer, overlapped grad reduction and param gather, small buckets, and context
parallelism cp 2/4 with each comm type p2p/allgather/a2a where the world still fits), and a
global batch of 1-4 micro-batches per data-parallel rank.

Context parallelism is drawn last, from a generator of its own (``random.Random`` of
``"cp-<seed>"``), and only where it fits in 8 ranks: the other dimensions of a seed's draw
stay what they were before cp was a dimension. The same holds for the sharding strategy
and optimizer CPU offload (``"shard-<seed>"``): where the distributed optimizer was drawn,
half the draws shard the gradients too (``--data-parallel-sharding-strategy optim_grads``)
and a third offload half or all of the optimizer state to the host; half of the
optim_grads draws then shard the parameters too (``optim_grads_params``, ZeRO-3; drawn
last, so the earlier draws of a seed are unchanged). Activation offload
(``--cpu-offloading``, 1 to num_layers - 1 layers per chunk) is drawn for a quarter of the
seeds from ``"act-offload-<seed>"``. Where the model is MoE, half the draws route the
DeepSeek-V3 way from ``"route-<seed>"`` (sigmoid scores, the 4 experts in 2 groups of which
a token uses one, the expert bias updated every step) and a quarter give
``--moe-layer-freq`` as a list with the first layer dense. Muon (``--optimizer muon``,
instead of AdamW or SGD, with ``--muon-tp-mode`` duplicated or distributed and Nesterov
momentum on or off) is drawn for a quarter of the AdamW draws from ``"optim-<seed>"``.
The pipeline schedule comes from ``"schedule-<seed>"``: a third of the draws without
virtual stages run zero bubble (``--pipeline-schedule zb_h1``: each backward split into B
and the deferred weight gradients W; also at pp 1); ZB-V (``zbv``: two chunks per rank in
a V, the split backward) takes a third of the draws with two virtual stages and a quarter
of the other even pipelines whose layers split into ``2 pp`` chunks, DualPipeV half of
those with at least ``2 pp`` micro-batches.
The attention variant comes from ``"attention-<seed>"``: multi-latent attention for a
quarter of the seeds (with or without a query latent, value heads as wide as the keys or
narrower, YaRN or plain RoPE, its up projections recomputed where selective
recomputation was drawn), QK norm for another sixth.
Where selective recomputation was drawn, half the seeds widen ``--recompute-modules`` from
``"recompute-<seed>"``: ``layernorm`` and, in an MoE model, ``moe`` (each for half of
those draws; ``mlp`` too for a third).
Multi-token prediction (``--mtp-num-layers`` 1 or 2, ``--mtp-loss-scaling-factor`` 0.1 or
0.3) comes for a fifth of the seeds from ``"mtp-<seed>"``, drawn after the others (with
any pipeline schedule: under zbv and dualpipev the depths sit on rank 0); under
pipeline parallelism a model with learned positions then takes RoPE (megalite refuses
the position table on a later stage), so the draw is not rejected.
fp8 GEMMs (``--fp8-format`` e4m3 or hybrid with ``--fp8-recipe`` tensorwise, delayed or
mxfp8; blockwise's 128-element blocks do not tile these sizes) come for a third of the
seeds from ``"fp8-<seed>"``; a drawn model whose GEMMs the recipe cannot tile
(validation refuses it) keeps its other dimensions and drops fp8. Where a per-tensor
recipe (tensorwise, delayed) meets the distributed optimizer (any sharding strategy), half
the seeds add ``--fp8-param-gather`` from ``"fp8-param-gather-<seed>"``.
The MoE all-to-all overlap (``--overlap-moe-expert-parallel-comm``, a third of those
with ``--delay-wgrad-compute``) comes for half of the accepted draws it applies to (MoE at
ep > 1, alltoall, 1F1B plain or interleaved, two or more micro-batches, no MoE or full
recomputation, no ZeRO-3, no activation offload) from ``"a2a-overlap-<seed>"``, after
acceptance: every other dimension of a seed stays what it was. Where shared experts were
drawn, half the accepted draws then run them inside the dispatch all-to-all
(``--moe-shared-expert-overlap``, kept where validation accepts it: alltoall, no
all-to-all overlap) from ``"shared-overlap-<seed>"``, likewise after acceptance.
Lion comes last, after acceptance, from ``"lion-<seed>"``: ``--optimizer lion`` for a
fifth of the fp32 AdamW draws without fp8, ``--muon-scalar-optimizer lion`` for half of
such Muon draws without linear biases (Lion would turn the key bias's gradient, zero but
for rounding, into steps of ``lr``).
QK-clip (``--qk-clip``) comes for a quarter of the seeds from ``"qkclip-<seed>"``, drawn
last: a threshold the tiny models' logits pass at once (0.02, 0.04) or never (100), alpha
0.3 / 0.5 / 0.7; where QK norm without multi-latent attention was drawn (which QK-clip
refuses) it becomes ``--log-max-attention-logit``, as it is for another eighth of the seeds.

Which combinations are legal is megalite's business, not the fuzzer's: a draw is kept only
if ``MegaliteConfig.validate`` and the pipeline's own layer split
(``megalite.pipeline.layout.chunk_layer_ranges``) accept it, and drawn again otherwise.
The draw is a pure function of the seed (``random.Random(seed)``), so
``MEGALITE_FUZZ_SEED=<seed> make fuzz`` draws the same layout again.
"""

from __future__ import annotations

import dataclasses
import random

from megalite.config import ConfigError
from tests.layouts import RECOMPUTE, SHORT, Layout, slug, tiny

MAX_WORLD = 8
MAX_ATTEMPTS = 1000
LLAMA = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
         "add_bias_linear": False}
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
       "moe_z_loss_coeff": 0.001}


def _sizes(rng: random.Random) -> dict:
    """tp, pp (+ virtual stages or an uneven first/last stage), dp; short names."""
    p = {"tp": rng.choice((1, 2, 2, 4)), "pp": rng.choice((1, 2, 2, 4)),
         "dp": rng.choice((1, 2, 2, 3, 4))}
    if p["tp"] > 1:
        p["sp"] = rng.random() < 0.5
    if p["pp"] > 1:
        shape = rng.choice(("even", "vpp", "vpp", "first", "last", "first+last"))
        if shape == "vpp":
            p["vpp"] = rng.choice((2, 2, 4) if p["pp"] == 2 else (2,))   # <= 8 layers
        for end in ("first", "last"):
            if end in shape:
                p[end] = rng.randint(1, 3)
    return p


def _num_layers(rng: random.Random, p: dict) -> int:
    """2-8 layers, drawn so that the pipeline shape usually fits (validation decides)."""
    if "vpp" in p:
        pieces = p["pp"] * p["vpp"]
        return pieces * rng.choice((1, 1, 2) if pieces <= 4 else (1,))
    if "first" in p or "last" in p:
        return rng.randint(2, 8)
    return p["pp"] * rng.choice((1, 2)) if p["pp"] > 1 else rng.choice((2, 3, 4))


def _model(rng: random.Random, num_layers: int) -> dict:
    m = {"num_layers": num_layers, "hidden_size": rng.choice((32, 64)),
         "num_attention_heads": 4, "vocab_size": rng.choice((50, 60))}
    if rng.random() < 0.5:
        m.update(LLAMA)
    groups = rng.choice((None, None, 1, 2))
    if groups is not None:
        m.update(group_query_attention=True, num_query_groups=groups)
    if rng.random() < 0.3:
        m["ffn_hidden_size"] = 48
    if rng.random() < 0.5:
        m["untie_embeddings_and_output_weights"] = True
    m.update(RECOMPUTE[rng.choice(tuple(RECOMPUTE))])
    if rng.random() < 0.4:
        m.update(MOE, moe_token_dispatcher_type=rng.choice(("alltoall", "allgather")))
        if rng.random() < 0.3:
            m["moe_layer_freq"] = 2
        if rng.random() < 0.3:
            m["moe_ffn_hidden_size"] = 32
        if rng.random() < 0.2:
            m["moe_shared_expert_intermediate_size"] = 32
        if rng.random() < 0.3:
            m["moe_router_score_function"] = "sigmoid"
    if rng.random() < 0.2:
        m["bf16"] = True
    return m


def _options(rng: random.Random, p: dict, moe: bool) -> None:
    """Expert sizes and the data-parallel options, into ``p``."""
    if moe:
        p["ep"] = rng.choice((1, 2, 2, 4))
        p["etp"] = rng.choice((p["tp"], p["tp"], 1, 2))
    if rng.random() < 0.5:
        p["distopt"] = True
        p["overlap_param"] = rng.random() < 0.5
    p["overlap_grad"] = rng.random() < 0.5
    if rng.random() < 0.5:
        p["bucket"] = 2000   # elements: parameters straddle buckets (and their dp shards)


def _optim(rng: random.Random) -> dict:
    """AdamW (the default) or SGD with momentum, which is linear in the gradient, so a
    gradient off by a constant factor shows in the parameters; clipping on or off."""
    o = {}
    if rng.random() < 0.4:
        o.update(optimizer="sgd", lr=0.05, min_lr=0.005)
    if rng.random() < 0.3:
        o["clip_grad"] = 0.0
    return o


def _train(rng: random.Random, p: dict) -> dict:
    """Micro-batch 1 or 2; 1, 2 or 4 micro-batches per data-parallel rank (a multiple of
    pp under virtual stages)."""
    micro = rng.choice((1, 2))
    num_micro = p["pp"] * rng.choice((1, 2)) if "vpp" in p else rng.choice((1, 2, 4))
    return {"micro_batch_size": micro, "global_batch_size": micro * p["dp"] * num_micro}


def _context_parallel(crng: random.Random, short: dict, model: dict, world: int) -> int:
    """cp 2 or 4 (half the draws) with a comm type, into ``short`` / ``model``,
    where ``world x cp`` fits; a2a only where the heads and groups per tp rank divide."""
    if crng.random() >= 0.5:
        return 1
    cp = crng.choice((2, 2, 4))
    comm = crng.choice(("p2p", "allgather", "a2a"))
    if world * cp > MAX_WORLD:
        return 1
    groups = model.get("num_query_groups", model["num_attention_heads"])
    if comm == "a2a" and (model["num_attention_heads"] % (short["tp"] * cp)
                          or groups % (short["tp"] * cp)):
        comm = "p2p"
    short["cp"] = cp
    model["cp_comm_type"] = comm
    return cp


def _sharding(srng: random.Random, short: dict, optim: dict) -> None:
    """optim_grads (or optim_grads_params) instead of the distributed optimizer's optim,
    and CPU offload (fraction 0.5 or 1), into ``short`` / ``optim``, where the distributed
    optimizer was drawn."""
    if not short.get("distopt"):
        return
    if srng.random() < 0.5:
        del short["distopt"]
        short["strategy"] = "optim_grads"
    if srng.random() < 1 / 3:
        optim.update(optimizer_cpu_offload=True,
                     optimizer_offload_fraction=srng.choice((0.5, 1.0)))
    if short.get("strategy") == "optim_grads" and srng.random() < 0.5:
        short["strategy"] = "optim_grads_params"


def _activation_offload(arng: random.Random, model: dict) -> None:
    """``--cpu-offloading`` of 1 .. num_layers - 1 layers per chunk (Megatron's bound), into
    ``model``, for a quarter of the draws."""
    if arng.random() < 0.25 and model["num_layers"] > 1:
        model.update(cpu_offloading=True,
                     cpu_offloading_num_layers=arng.randint(1, model["num_layers"] - 1))


def _routing(rrng: random.Random, model: dict) -> None:
    """DeepSeek-V3 routing (half the MoE draws), a list ``--moe-layer-freq`` (a
    quarter) and, for a third of the softmax draws, ``--moe-router-pre-softmax``
    (Qwen3-MoE's ``norm_topk_prob=False``), into ``model``."""
    if "num_experts" not in model:
        return
    if rrng.random() < 0.5:
        model.update(moe_router_score_function="sigmoid", moe_router_num_groups=2,
                     moe_router_group_topk=1, moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.05)
    if rrng.random() < 0.25 and model["num_layers"] > 1:
        model["moe_layer_freq"] = f"[0]+[1]*{model['num_layers'] - 1}"
    if model.get("moe_router_score_function", "softmax") == "softmax" \
            and rrng.random() < 1 / 3:
        model["moe_router_pre_softmax"] = True


def _muon(orng: random.Random, optim: dict, split: bool, model: dict) -> None:
    """``--optimizer muon`` instead of AdamW (a quarter of the draws; SGD draws stay SGD,
    whose update is linear in the gradient), into ``optim``; where a matrix is split over
    tp or etp (``split``), in a layout-invariant tp mode (duplicated or distributed).
    Not for bf16 MoE models: Muon's update has the same size whatever the gradient's, so
    a token that bf16 rounding routes to another expert near a tie (more so with the
    expert bias, whose sign update turns one token into a different bias) moves that
    expert's whole update by up to ``lr``, past the bf16 tolerance (seen: 1.4e-2 on 2
    elements); fp32 MoE draws check Muon exactly."""
    if (orng.random() < 0.25 and optim.get("optimizer") != "sgd"
            and not (model.get("bf16") and "num_experts" in model)):
        mode = orng.choice(("duplicated", "distributed"))
        optim.update(optimizer="muon", muon_nesterov=orng.random() < 0.5)
        if split and mode != "duplicated":
            optim["muon_tp_mode"] = mode


def _schedule(zrng: random.Random, short: dict, num_layers: int, num_micro: int) -> None:
    """``--pipeline-schedule zb_h1`` for a third of the draws without virtual stages; ZB-V
    (``zbv``, two chunks per rank in a V) for a third of the draws with two virtual stages,
    and for a quarter of the other even pipelines whose layers split into ``2 pp`` chunks
    (drawn after the zb_h1 choice, so that choice stays what it was); half the ZB-V draws
    with at least ``2 pp`` micro-batches run DualPipeV instead."""
    pp = short["pp"]
    if "vpp" not in short and zrng.random() < 1 / 3:
        short["schedule"] = "zb_h1"
    elif short.get("vpp") == 2:
        if zrng.random() < 1 / 3:
            short["schedule"] = "zbv"
    elif ("vpp" not in short and pp > 1 and "first" not in short and "last" not in short
          and num_layers % (2 * pp) == 0 and zrng.random() < 1 / 4):
        short["schedule"] = "zbv"
    if short.get("schedule") == "zbv" and num_micro >= 2 * pp and zrng.random() < 0.5:
        short["schedule"] = "dualpipev"


def _attention_variant(vrng: random.Random, model: dict) -> None:
    """Multi-latent attention (a quarter of the draws) or QK norm (a sixth), into
    ``model``."""
    x = vrng.random()
    if x < 0.25:
        model.update(multi_latent_attention=True, qk_layernorm=vrng.random() < 0.75,
                     q_lora_rank=vrng.choice((None, 16)), kv_lora_rank=16, qk_head_dim=8,
                     qk_pos_emb_head_dim=4, v_head_dim=vrng.choice((6, 12)),
                     rotary_scaling_factor=vrng.choice((1.0, 4.0)),
                     mscale_all_dim=vrng.choice((0.0, 1.0)),
                     original_max_position_embeddings=8)
        model.pop("num_query_groups", None)
        model["group_query_attention"] = False
        if model.get("recompute_granularity") == "selective" and vrng.random() < 0.5:
            model["recompute_modules"] = vrng.choice((["mla_up_proj"],
                                                      ["core_attn", "mla_up_proj"]))
    elif x < 0.25 + 1 / 6:
        model["qk_layernorm"] = True


def _recompute_modules(mrng: random.Random, model: dict) -> None:
    """Under selective recomputation, half the draws add ``layernorm`` / ``moe`` / ``mlp``
    to ``--recompute-modules`` (over the drawn kinds, or the default ``core_attn``)."""
    if model.get("recompute_granularity") != "selective" or mrng.random() >= 0.5:
        return
    modules = list(model.get("recompute_modules") or ["core_attn"])
    layernorm, moe, mlp = mrng.random() < 0.5, mrng.random() < 0.5, mrng.random() < 1 / 3
    modules += [k for k, on in (("layernorm", layernorm), ("moe", moe and "num_experts" in
                                                          model), ("mlp", mlp)) if on]
    model["recompute_modules"] = modules


def _mtp(trng: random.Random, model: dict, pp: int) -> None:
    """Multi-token prediction depths (a fifth of the draws, any pipeline schedule: under a V
    one they run on rank 0's chunk 1), into ``model``."""
    if trng.random() >= 0.2:
        return
    model.update(mtp_num_layers=trng.choice((1, 2)),
                 mtp_loss_scaling_factor=trng.choice((0.1, 0.3)))
    if pp > 1 and model.get("position_embedding_type", "learned_absolute") \
            == "learned_absolute":
        model["position_embedding_type"] = "rope"


FP8_RECIPES = ("tensorwise", "delayed", "mxfp8")


def _fp8(frng: random.Random, model: dict) -> None:
    """fp8 GEMMs (a format, a recipe; delayed: a history of 1-3 steps, max or most recent)
    into ``model``, for a third of the draws."""
    if frng.random() >= 1 / 3:
        return
    model.update(fp8_format=frng.choice(("e4m3", "hybrid")),
                 fp8_recipe=frng.choice(FP8_RECIPES))
    if model["fp8_recipe"] == "delayed":
        model.update(fp8_amax_history_len=frng.randint(1, 3),
                     fp8_amax_compute_algo=frng.choice(("max", "most_recent")))


def _fp8_param_gather(grng: random.Random, model: dict, short: dict) -> None:
    """--fp8-param-gather for half the draws of a per-tensor fp8 recipe under the
    distributed optimizer (a number is drawn every time, so the stream stays aligned)."""
    x = grng.random()
    distributed = short.get("distopt") or short.get("strategy", "no_shard") != "no_shard"
    if x < 0.5 and distributed and model.get("fp8_recipe") in ("tensorwise", "delayed") \
            and model.get("fp8_format"):
        model["fp8_param_gather"] = True


def _qk_clip(qrng: random.Random, model: dict) -> None:
    """--qk-clip (a quarter of the draws; its threshold, alpha) or only
    --log-max-attention-logit (an eighth, and the QK-clip draws of a QK-norm model)."""
    x = qrng.random()
    threshold, alpha = qrng.choice((0.02, 0.04, 100.0)), qrng.choice((0.3, 0.5, 0.7))
    clip_ok = model.get("multi_latent_attention") or not model.get("qk_layernorm")
    if x < 0.25 and clip_ok:
        model.update(qk_clip=True, qk_clip_threshold=threshold, qk_clip_alpha=alpha)
    elif x < 0.25 + 1 / 8:
        model["log_max_attention_logit"] = True


def _without_fp8(layout: Layout) -> Layout:
    model = {k: v for k, v in layout.model.items() if not k.startswith("fp8_")}
    name = layout.name.replace(f"-fp8{layout.model.get('fp8_recipe')}", "")
    name = name.replace("-fp8pg", "")
    return dataclasses.replace(layout, name=name, model=model)


def _draw_once(rng: random.Random, seed: int, crng: random.Random,
               srng: random.Random, arng: random.Random,
               rrng: random.Random, orng: random.Random | None = None,
               zrng: random.Random | None = None,
               vrng: random.Random | None = None,
               frng: random.Random | None = None,
               mrng: random.Random | None = None,
               qrng: random.Random | None = None,
               trng: random.Random | None = None,
               grng: random.Random | None = None) -> Layout | None:
    short = _sizes(rng)
    world = short["tp"] * short["pp"] * short["dp"]
    model = _model(rng, _num_layers(rng, short))
    _options(rng, short, "num_experts" in model)
    train, optim = _train(rng, short), _optim(rng)
    if world > MAX_WORLD:
        return None
    world *= _context_parallel(crng, short, model, world)
    _sharding(srng, short, optim)
    _activation_offload(arng, model)
    _routing(rrng, model)
    if orng is not None:
        _muon(orng, optim, short["tp"] > 1 or short.get("etp", 1) > 1, model)
    if zrng is not None:
        _schedule(zrng, short, model["num_layers"],
                  train["global_batch_size"] // (train["micro_batch_size"] * short["dp"]))
    if vrng is not None:
        _attention_variant(vrng, model)
    if frng is not None:
        _fp8(frng, model)
    if grng is not None:
        _fp8_param_gather(grng, model, short)
    if mrng is not None:
        _recompute_modules(mrng, model)
    if qrng is not None:
        _qk_clip(qrng, model)
    if trng is not None:
        _mtp(trng, model, short["pp"])
    parallel = {SHORT[k]: v for k, v in short.items() if k != "dp"}
    marks = [k for k, on in (("moe", "num_experts" in model),
                             ("bias", model.get("moe_router_enable_expert_bias")),
                             ("presoftmax", model.get("moe_router_pre_softmax")),
                             ("bf16", model.get("bf16")),
                             ("sgd", optim.get("optimizer") == "sgd"),
                             ("muon", optim.get("optimizer") == "muon"),
                             ("offload", optim.get("optimizer_cpu_offload")),
                             ("actoff", model.get("cpu_offloading")),
                             ("mla", model.get("multi_latent_attention")),
                             ("qknorm", model.get("qk_layernorm")
                              and not model.get("multi_latent_attention")),
                             (f"fp8{model.get('fp8_recipe')}", model.get("fp8_format")),
                             ("fp8pg", model.get("fp8_param_gather")),
                             ("qkclip", model.get("qk_clip")),
                             ("maxlogit", model.get("log_max_attention_logit")),
                             (f"mtp{model.get('mtp_num_layers')}",
                              model.get("mtp_num_layers")))
             if on]
    if "cp" in short:
        marks.insert(0, model["cp_comm_type"])
    name = "-".join([f"fuzz{seed}", slug(world, parallel), *marks])
    return Layout(name, world, parallel, model, train, ("fuzz",), optim)


def rejection(layout: Layout) -> str | None:
    """Why megalite refuses this layout (its own validation), or None if it accepts it."""
    from megalite.config.layout import chunk_layer_ranges

    try:
        cfg = tiny(layout)
        p = cfg.parallel
        chunk_layer_ranges(cfg.model.num_layers, p.pipeline_model_parallel_size,
                           p.virtual_pipeline_model_parallel_size,
                           p.decoder_first_pipeline_num_layers,
                           p.decoder_last_pipeline_num_layers)
    except ConfigError as e:
        return str(e)
    return None


def _a2a_overlap(prng: random.Random, layout: Layout) -> Layout:
    """``--overlap-moe-expert-parallel-comm`` for half the accepted draws it applies to
    (MoE over ep > 1 with the alltoall dispatcher, 1F1B plain or interleaved, two or more
    micro-batches, ...: whatever megalite's validation accepts), a third of those with
    ``--delay-wgrad-compute``; drawn after acceptance from its own generator, so the rest
    of the draw is what it was."""
    on, delay = prng.random() < 0.5, prng.random() < 1 / 3
    if not on or "num_experts" not in layout.model:
        return layout
    flags = {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": delay}
    marks = "-a2aov" + ("-dwg" if delay else "")
    drawn = dataclasses.replace(layout, name=layout.name + marks,
                                parallel={**layout.parallel, **flags})
    return drawn if rejection(drawn) is None else layout


def _shared_overlap(hrng: random.Random, layout: Layout) -> Layout:
    """``--moe-shared-expert-overlap`` for half the accepted draws with shared experts,
    where validation accepts it; from its own generator, after acceptance."""
    on = hrng.random() < 0.5
    if not on or "moe_shared_expert_intermediate_size" not in layout.model:
        return layout
    drawn = dataclasses.replace(layout, name=layout.name + "-shov",
                                model={**layout.model, "moe_shared_expert_overlap": True})
    return drawn if rejection(drawn) is None else layout


def _lion(lrng: random.Random, layout: Layout) -> Layout:
    """``--optimizer lion`` for a fifth of the accepted AdamW draws, and
    ``--muon-scalar-optimizer lion`` for half the Muon draws of models without linear
    biases; fp32 models without fp8 only. Lion moves every element by ``lr`` times a sign:
    bf16 or fp8 rounding flips the sign of small elements between layouts (2 ``lr`` apart,
    past those tolerances over three steps), and the attention's key bias, whose gradient
    is 0 but for rounding (a constant added to every logit of a row leaves the softmax as
    it was), would take a step of ``lr`` whose sign is that rounding's where it is Lion's
    (Muon's scalar parameters; ``--optimizer lion`` gives biases to AdamW, whose epsilon
    keeps such a gradient's step near 0). From its own generator, after acceptance."""
    x = lrng.random()
    optimizer = layout.optim.get("optimizer", "adam")
    if layout.model.get("bf16") or layout.model.get("fp8_format"):
        return layout
    if optimizer == "adam" and x < 0.2:
        optim, mark = {**layout.optim, "optimizer": "lion"}, "-lion"
    elif optimizer == "muon" and x < 0.5 and not layout.model.get("add_bias_linear", True):
        optim, mark = {**layout.optim, "muon_scalar_optimizer": "lion"}, "-lion"
    else:
        return layout
    drawn = dataclasses.replace(layout, name=layout.name + mark, optim=optim)
    return drawn if rejection(drawn) is None else layout


def draw_layout(seed: int) -> Layout:
    """The layout of ``seed``: the first draw of ``random.Random(seed)`` that fits 1 to 8
    ranks and that megalite accepts."""
    rng, crng = random.Random(seed), random.Random(f"cp-{seed}")
    srng, arng = random.Random(f"shard-{seed}"), random.Random(f"act-offload-{seed}")
    rrng, orng = random.Random(f"route-{seed}"), random.Random(f"optim-{seed}")
    zrng, vrng = random.Random(f"schedule-{seed}"), random.Random(f"attention-{seed}")
    frng, mrng = random.Random(f"fp8-{seed}"), random.Random(f"recompute-{seed}")
    qrng, trng = random.Random(f"qkclip-{seed}"), random.Random(f"mtp-{seed}")
    grng = random.Random(f"fp8-param-gather-{seed}")
    prng, hrng = random.Random(f"a2a-overlap-{seed}"), random.Random(f"shared-overlap-{seed}")
    lrng = random.Random(f"lion-{seed}")
    for _ in range(MAX_ATTEMPTS):
        layout = _draw_once(rng, seed, crng, srng, arng, rrng, orng, zrng, vrng, frng, mrng,
                            qrng, trng, grng)
        if layout is None:
            continue
        if rejection(layout) is None:
            return _lion(lrng, _shared_overlap(hrng, _a2a_overlap(prng, layout)))
        if "fp8_format" in layout.model and rejection(_without_fp8(layout)) is None:
            return _lion(lrng, _shared_overlap(hrng, _a2a_overlap(prng, _without_fp8(layout))))
    raise RuntimeError(f"no valid layout in {MAX_ATTEMPTS} draws of seed {seed}")
