#!/usr/bin/env python
"""Write the Megatron-Core checkpoints under ``fixtures/`` with Megatron-Core itself.

The fixtures are real ``torch_dist`` (and ``*_legacy``: ``--ckpt-format torch``, one
``mp_rank_TT_PPP/model_optim_rng.pt`` per rank) checkpoints saved by Megatron-LM's own
``megatron.training.checkpointing.save_checkpoint`` (with the ``args`` namespace of
``megatron.training.arguments``) from Megatron-Core ``GPTModel``s built with the local
(non-Transformer-Engine) layer spec on CPU over gloo. Next to each checkpoint,
``logits.pt`` holds ``{"tokens": [b, s] int64, "logits": [b, s, padded_vocab] fp32}``: the
Megatron model's own forward on a fixed token batch, which the import tests compare with.
CI reads the committed files and needs no Megatron-Core; run this only to regenerate them.

Megatron-Core lives in its own virtual environment, outside the repository (it wants
Python >= 3.12; 0.19.2 runs on 3.11 with the ``typing.override`` shim below)::

    python3 -m venv /work/mcore-venv
    /work/mcore-venv/bin/pip install torch==2.13.0          # the CPU build, as megalite's
    /work/mcore-venv/bin/pip install megatron-core==0.19.2 --no-deps --ignore-requires-python
    /work/mcore-venv/bin/pip install einops psutil numpy packaging
    /work/mcore-venv/bin/pip install triton --no-deps
    /work/mcore-venv/bin/pip install emerging-optimizers==0.3.0 --no-deps \
        --ignore-requires-python                              # --optimizer lion's Lion
    /work/mcore-venv/bin/pip install absl-py
    /work/mcore-venv/bin/python tests/checkpoint/megatron/make_fixtures.py [NAME ...]

Each fixture is one ``torchrun`` of this file in worker mode (tp x pp x ep gloo ranks).
The ``*_trained`` fixtures (``trained.py`` beside this file) are trained a few steps by
Megatron-Core's DDP, optimizer and scheduler first and saved with their optimizer state.

It also checks an export: after ``convert_checkpoint.py --source megatron`` of fixture
NAME and ``--source megalite --target megatron`` of the result into DIR,

    /work/mcore-venv/bin/python tests/checkpoint/megatron/make_fixtures.py --check-export NAME DIR

loads DIR with Megatron-LM's ``load_checkpoint`` (``--finetune``) into NAME's model at
NAME's tp x pp and prints the largest logit difference from the fixture's (exit 1 above
1e-5). For a trained fixture exported with its optimizer state,

    /work/mcore-venv/bin/python tests/checkpoint/megatron/make_fixtures.py --check-resume NAME DIR

resumes NAME's run from DIR in Megatron-LM and compares its next step with the one
Megatron took from its own checkpoint (``next_step.pt``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import typing
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("FIXTURES_OUT", os.path.join(HERE, "fixtures"))  # elsewhere: to compare
ITERATION = 1
TOKENS_SHAPE = (2, 12)   # [b, s] of the logits batch
COMMON = ["--seq-length", "16", "--max-position-embeddings", "32", "--micro-batch-size", "1",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
          "--make-vocab-size-divisible-by", "16", "--init-method-std", "0.1",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
          "--transformer-impl", "local", "--use-cpu-initialization",
          "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
          "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
          "--no-rope-fusion", "--no-persist-layer-norm", "--ckpt-format", "torch_dist",
          "--no-save-optim", "--no-save-rng", "--lr", "1e-4", "--train-iters", "1",
          "--save-interval", "1"]
GPT2 = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--ffn-hidden-size", "64", "--normalization", "LayerNorm",
        "--position-embedding-type", "learned_absolute"]
LLAMA = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--rotary-base", "10000", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6"]
MIXTRAL = [*LLAMA, "--num-layers", "2", "--ffn-hidden-size", "48", "--num-experts", "4",
           "--moe-router-topk", "2",
           "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.0",
           "--moe-token-dispatcher-type", "allgather"]
# Qwen3: grouped-query attention with per-head QK RMSNorm, a head dim other than hidden/heads
QWEN3 = [*LLAMA, "--num-layers", "2", "--kv-channels", "16", "--qk-layernorm",
         "--rotary-base", "1000000"]
# DeepSeek-V3's multi-latent attention: query and key/value latents (normed: --qk-layernorm),
# a decoupled RoPE part, YaRN (a factor, mscale, mscale_all_dim)
MLA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8",
       "--qk-layernorm", "--rotary-scaling-factor", "4", "--mscale", "1.0",
       "--mscale-all-dim", "0.8", "--ffn-hidden-size", "64", "--normalization", "RMSNorm",
       "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6"]
# DeepSeek-V2-Lite's: the queries not low-rank (and no latent norms: Megatron-Core's local
# spec refuses --qk-layernorm without --q-lora-rank)
MLA_NO_Q_LORA = [f for i, f in enumerate(MLA) if f != "--qk-layernorm"
                 and i not in (MLA.index("--q-lora-rank"), MLA.index("--q-lora-rank") + 1)]
# DeepSeek-V3's routing: a dense first layer, fine-grained experts with a shared expert,
# sigmoid scores, aux-loss-free balancing (a nonzero expert bias is saved), group-limited
DEEPSEEK_ROUTING = [
    "--num-layers", "3", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "32",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-layer-freq", "[0]+[1]*2",
    "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.0",
    "--moe-token-dispatcher-type", "allgather"]
MOE_BIAS = [*LLAMA, *DEEPSEEK_ROUTING]
DEEPSEEK_V3 = [*MLA, *DEEPSEEK_ROUTING]   # both: multi-latent attention in every layer
# name -> (model flags, tp, pp)
FIXTURES = {
    "gpt2_tp1_pp1": (GPT2, 1, 1),
    "gpt2_tp2_pp2": (GPT2, 2, 2),
    "llama_tp1_pp1": (LLAMA, 1, 1),
    "llama_tp2_pp2": (LLAMA, 2, 2),
    "mixtral_tp1_pp1": (MIXTRAL, 1, 1),
    # the legacy per-rank format (iter_N/mp_rank_XX_YYY/model_optim_rng.pt)
    "gpt2_tp2_pp2_legacy": ([*GPT2, "--ckpt-format", "torch"], 2, 2),
    "llama_tp2_pp2_legacy": ([*LLAMA, "--ckpt-format", "torch"], 2, 2),
    # experts over 2 ranks (data parallel 2 = expert parallel 2)
    "mixtral_ep2": ([*MIXTRAL, "--expert-model-parallel-size", "2"], 1, 1),
    # virtual pipelining: 2 stages x 2 chunks of one layer
    "llama_pp2_vpp2": ([*LLAMA, "--num-layers-per-virtual-pipeline-stage", "1"], 1, 2),
    "llama_pp2_vpp2_legacy": ([*LLAMA, "--num-layers-per-virtual-pipeline-stage", "1",
                               "--ckpt-format", "torch"], 1, 2),
    "mixtral_ep2_legacy": ([*MIXTRAL, "--expert-model-parallel-size", "2", "--ckpt-format",
                            "torch"], 1, 1),
    "qwen3_tp1_pp1": (QWEN3, 1, 1),
    # multi-token prediction: two depths over a tp 2 x pp 2 Llama (the depths on the last
    # stage), and one DeepSeek-V3-shaped depth (multi-latent attention, routed and shared
    # experts) over ep 2
    "llama_mtp_tp2_pp2": ([*LLAMA, "--mtp-num-layers", "2"], 2, 2),
    "llama_mtp_tp2_pp2_legacy": ([*LLAMA, "--mtp-num-layers", "2", "--ckpt-format", "torch"],
                                 2, 2),
    "deepseek_v3_mtp_ep2": ([*DEEPSEEK_V3, "--num-layers", "2", "--moe-layer-freq", "[0]+[1]",
                             "--mtp-num-layers", "1", "--expert-model-parallel-size", "2"],
                            1, 1),
    "qwen3_tp2_pp2": (QWEN3, 2, 2),
    "mla_tp2_pp2": (MLA, 2, 2),
    "mla_noqlora_pp2": (MLA_NO_Q_LORA, 1, 2),
    "moe_bias_ep2": ([*MOE_BIAS, "--expert-model-parallel-size", "2"], 1, 1),
    # not committed, to keep the fixtures small (write them elsewhere with FIXTURES_OUT,
    # import them and --check-export them by hand): legacy files of the same, DeepSeek-V3's
    # attention and routing together, and a Qwen3-MoE
    "mla_tp2_pp2_legacy": ([*MLA, "--ckpt-format", "torch"], 2, 2),
    "moe_bias_tp2_ep2_legacy": ([*MOE_BIAS, "--expert-model-parallel-size", "2",
                                 "--ckpt-format", "torch"], 2, 1),
    "deepseek_v3_ep2": ([*DEEPSEEK_V3, "--expert-model-parallel-size", "2"], 1, 1),
    # Qwen3-MoE with norm_topk_prob=False (--moe-router-pre-softmax), every other layer MoE
    "qwen3_moe_pre_softmax_tp2": ([*QWEN3, "--num-experts", "4", "--moe-router-topk", "2",
                                   "--moe-ffn-hidden-size", "16", "--moe-router-pre-softmax",
                                   "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "0.0",
                                   "--moe-token-dispatcher-type", "allgather"], 2, 1),
}
# fixtures whose layers Megatron builds with the decoder block spec (qk norm, multi-latent
# attention, a --moe-layer-freq list); the others keep the one-layer local spec
BLOCK_SPEC = ("qwen3", "mla_", "moe_bias_", "deepseek_")


def _flag(flags: list[str], key: str) -> int:
    """An integer flag's value in ``flags`` (1 when absent)."""
    return int(flags[flags.index(key) + 1]) if key in flags else 1


def _ep(flags: list[str]) -> int:
    return _flag(flags, "--expert-model-parallel-size")


# -- driver ------------------------------------------------------------------------------------
def _trained():
    """The trained fixtures' module, ``trained.py`` beside this file (imported as part of
    the tests package, or from this directory when this file runs as a script)."""
    try:
        from tests.checkpoint.megatron import trained
    except ImportError:
        import trained
    return trained


def _torchrun(name: str, *worker_args: str) -> None:
    trained = _trained()
    if name in trained.TRAINED:
        flags, dp = trained.TRAINED[name]
        world = dp * _flag(flags, "--tensor-model-parallel-size") * _flag(
            flags, "--pipeline-model-parallel-size")
    else:
        flags, tp, pp = FIXTURES[name]
        world = tp * pp * _ep(flags)   # the experts' ranks are data-parallel ones
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(29500 + zlib.crc32(name.encode()) % 1000),
           os.path.abspath(__file__), *worker_args]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def check_export(name: str, directory: str) -> int:
    """Load ``directory`` (``convert_checkpoint.py --target megatron`` output) in
    Megatron-Core at fixture ``name``'s model and layout; writes
    ``directory/megatron_logits.pt`` and prints the largest difference from the fixture's
    logits (the export of an import of that fixture gives them back)."""
    import torch

    _torchrun(name, "--check-export", name, os.path.abspath(directory))
    got = torch.load(os.path.join(directory, "megatron_logits.pt"))
    want = torch.load(os.path.join(OUT, name, "logits.pt"))
    vocab = min(got["logits"].shape[-1], want["logits"].shape[-1], 101)
    diff = max((got[k][..., :vocab] - want[k][..., :vocab]).abs().max().item()
               for k in ("logits", "mtp_logits") if k in want)
    print(f"{name}: Megatron-Core loaded {directory}; max |logit difference| {diff:.3g}")
    return 0 if diff <= 1e-5 else 1


def main(names: list[str]) -> int:
    trained, corpus = _trained(), None
    for name in names or [*FIXTURES, *trained.TRAINED]:
        dest = os.path.join(OUT, name)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        if name in trained.TRAINED:
            corpus = corpus or trained.small_vocab_corpus(
                os.path.join(tempfile.mkdtemp(), "corpus"))
            _torchrun(name, "--train", name, dest, corpus)
        else:
            _torchrun(name, "--worker", name, dest)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dest) for f in fs)
        print(f"wrote {dest} ({size / 1024:.0f} KiB)")
    return 0


# -- worker (one rank of torchrun, inside the Megatron-Core venv) -------------------------------
def _shims():
    """What Megatron asks of CUDA or of Python 3.12 on a CPU-only Python 3.11."""
    import torch

    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.Tensor.cuda = lambda self, *a, **k: self   # tied embeddings' all-reduce at init
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 10   # no CUDA_DEVICE_MAX_CONNECTIONS rule
    from megatron.training import checkpointing

    def read_tracker(path):   # Megatron's all-reduces the iteration in a CUDA tensor
        text = open(path).read().strip()
        return (0, True) if text == "release" else (int(text), False)

    checkpointing.read_metadata = read_tracker
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda *a, **k: None
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    # Megatron-Core 0.19.2's multi-latent attention passes k_channels / v_channels to its
    # core attention, which the local DotProductAttention does not take (only Transformer
    # Engine's does): it reads the key head dim from the tensors and lays the context out
    # by kv_channels, so the MLA fixtures keep --v-head-dim equal to hidden / heads
    init = DotProductAttention.__init__

    def local_attention(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        assert v_channels in (None, config.kv_channels), (v_channels, config.kv_channels)
        init(self, config, *args, **kwargs)

    DotProductAttention.__init__ = local_attention


def _perturb(model, tp_rank: int) -> None:
    """Norm weights and biases, which Megatron initializes to constants, get seeded noise
    (by name, and by tp rank where tensor-parallel) so a mapping slip shows in the logits;
    replicated tensors stay equal across tp ranks. A router's expert bias (zero at
    initialization) gets seeded noise of the scores' scale, so it changes the routing."""
    import torch

    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
        for name, p in model.named_parameters():
            if not (name.endswith("bias") or "norm" in name):
                continue
            seed = zlib.crc32(name.encode())
            if getattr(p, "tensor_model_parallel", False):
                seed += 7919 * tp_rank
            g = torch.Generator().manual_seed(seed)
            p.add_(0.2 * torch.randn(p.shape, generator=g))


def _build(args, name, vp_stage=None):
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    tied = not args.untie_embeddings_and_output_weights
    if name.startswith(BLOCK_SPEC):   # local (non-Transformer-Engine) layers, per layer
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=args.normalization, vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, False,
                                        normalization=args.normalization)
    mtp = (get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False,
                                  vp_stage=vp_stage) if args.mtp_num_layers else None)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     pre_process=mpu.is_pipeline_first_stage(False, vp_stage),
                     post_process=mpu.is_pipeline_last_stage(False, vp_stage),
                     parallel_output=True, vp_stage=vp_stage,
                     share_embeddings_and_output_weights=tied,
                     position_embedding_type=args.position_embedding_type,
                     rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                     mtp_block_spec=mtp)
    return model.to(torch.float32)


def _logits(models, args, tokens):
    """Full ``[b, s, padded_vocab]`` logits on the last stage (None elsewhere): the model
    chunks run in pipeline order (chunk-major under virtual pipelining), hidden states
    ``[s, b, h]`` sent over the pipeline group; vocabulary shards gathered over the
    tensor group. With multi-token prediction, ``(logits, depths)``: ``depths`` ``[N, b,
    s, padded_vocab]`` each depth's logits (its calls of the output layer, which come
    before the main head's)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    pp_group = mpu.get_pipeline_model_parallel_group()
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    ranks = dist.get_process_group_ranks(pp_group)
    out, calls = None, []
    last = models[-1]
    if getattr(last, "post_process", False) and args.mtp_num_layers:
        # a copy: Megatron's cross entropy works in place on the logits it is given
        last.output_layer.register_forward_hook(lambda m, i, o: calls.append(o[0].clone()))
    for v, model in enumerate(models):
        if not (v == 0 and mpu.is_pipeline_first_stage()):
            hidden = torch.empty(s, b, args.hidden_size)
            dist.recv(hidden, src=ranks[pp_rank - 1], group=pp_group)  # [-1]: wraps around
            model.set_input_tensor(hidden)
        with torch.no_grad():
            out = model(tokens, positions, mask)
        if not (v == len(models) - 1 and mpu.is_pipeline_last_stage()):
            dist.send(out.contiguous(), dst=ranks[(pp_rank + 1) % len(ranks)], group=pp_group)
            out = None
    if out is None:
        return None
    tp_group = mpu.get_tensor_model_parallel_group()

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, x.contiguous(), group=tp_group)
        return torch.cat(parts, dim=-1)

    if not args.mtp_num_layers:
        return gather(out)
    assert len(calls) == args.mtp_num_layers + 1, len(calls)
    depths = torch.stack([gather(c).transpose(0, 1) for c in calls[:-1]])   # [N, b, s, V]
    return gather(out), depths


def worker(name: str, dest: str, check: bool = False) -> None:
    """Save fixture ``name`` into ``dest``; with ``check``, load ``dest`` instead (a
    checkpoint megalite exported) into the same model and write its logits there."""
    _shims()
    import torch
    import torch.distributed as dist

    flags, tp, pp = FIXTURES[name]
    sys.argv = [sys.argv[0], *COMMON, *flags, "--tensor-model-parallel-size", str(tp),
                "--pipeline-model-parallel-size", str(pp), "--save", dest, "--load", dest]
    if check:
        sys.argv += ["--finetune", "--no-load-optim", "--no-load-rng"]
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron.training.global_vars import set_global_variables

    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=True)
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(
        tp, pp, virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=_ep(flags))
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    vpp = args.virtual_pipeline_model_parallel_size
    models = ([_build(args, name, v) for v in range(vpp)] if vpp
              else [_build(args, name)])
    tokens = torch.randint(0, 100, TOKENS_SHAPE, generator=torch.Generator().manual_seed(5))
    if check:
        load_checkpoint(models, None, None)
        logits = _logits([m.eval() for m in models], args, tokens)
        if logits is not None and mpu.get_tensor_model_parallel_rank() == 0:
            torch.save(_record(tokens, logits), os.path.join(dest, "megatron_logits.pt"))
        dist.destroy_process_group()
        return
    for model in models:
        _perturb(model, mpu.get_tensor_model_parallel_rank())
        model.eval()
    logits = _logits(models, args, tokens)
    save_checkpoint(ITERATION, models, None, None, 0)
    dist.barrier()
    if logits is not None and mpu.get_tensor_model_parallel_rank() == 0:
        torch.save(_record(tokens, logits), os.path.join(dest, "logits.pt"))
        with open(os.path.join(dest, "fixture.json"), "w") as f:
            json.dump({"made_by": "megatron-core " + _version(), "tp": tp, "pp": pp,
                       "flags": [*COMMON, *flags],
                       "padded_vocab_size": args.padded_vocab_size}, f, indent=1)
    dist.destroy_process_group()


def _record(tokens, logits) -> dict:
    """What ``logits.pt`` holds: the tokens, the logits and, with multi-token prediction,
    ``mtp_logits`` ``[N, b, s, padded_vocab]``."""
    if isinstance(logits, tuple):
        return {"tokens": tokens, "logits": logits[0], "mtp_logits": logits[1]}
    return {"tokens": tokens, "logits": logits}


def _version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def check_resume(name: str, directory: str) -> int:
    """Resume the trained fixture ``name``'s run in Megatron-LM from ``directory`` (an
    export of iteration 2 with the optimizer state: ``convert_checkpoint.py --target
    megatron`` of the fixture's import) and compare its next step with the fixture's
    ``next_step.pt``; prints the comparison and exits 1 when the loss differs by more
    than 2e-6, a weight by more than 1e-6, or an fp16 run's loss scale after the step
    from the one Megatron's own run reached (so the export's ``grad_scaler`` was loaded)."""
    trained = _trained()
    corpus = trained.small_vocab_corpus(os.path.join(tempfile.mkdtemp(), "corpus"))
    _torchrun(name, "--train", name, os.path.join(OUT, name), corpus,
              os.path.abspath(directory))
    with open(os.path.join(directory, "resumed.json")) as f:
        got = json.load(f)
    print(f"{name}: Megatron-LM resumed {directory}: {got}")
    worst = got["max_weight_difference"]
    ok = (abs(got["loss"] - got["want_loss"]) <= 2e-6 and got["lr"] == got["want_lr"]
          and (worst is None or worst <= 1e-6)
          and got.get("grad_scaler") == got.get("want_grad_scaler"))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--train":
        _trained().train_worker(*sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--check-resume":
        sys.exit(check_resume(sys.argv[2], sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] in ("--worker", "--check-export"):
        if "RANK" in os.environ:
            worker(sys.argv[2], sys.argv[3], check=sys.argv[1] == "--check-export")
        else:
            sys.exit(check_export(sys.argv[2], sys.argv[3]))
    else:
        tempfile.tempdir = None
        sys.exit(main(sys.argv[1:]))
