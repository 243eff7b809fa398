"""Shared by the parallel generation tests: random-weight GPT-2 / Llama / Mixtral
checkpoints saved at tp=1, what one rank generates at a layout, and the check that a
layout's ranks equal one process."""

import json
import urllib.error
import urllib.request

import torch

from megalite.checkpoint.consolidated import save_full_model
from megalite.config import MegaliteConfig
from megalite.inference.generation import generate, generate_batch
from megalite.inference.kv_cache import InferenceCache
from megalite.inference.loading import inference_state, load_model
from megalite.inference.stages import from_last_stage, stage_forward
from megalite.models.gpt import GPTModel
from megalite.parallel.mappings import gather_from_tensor_model_parallel_region
from tests.model.common import gpt2_config, llama_config, mixtral_config, single_process_state
from tests.model.test_hf_parity import _random_weights

PROMPTS = [[3, 17, 41, 8, 29], [9], [22, 4, 31, 40, 2, 11, 6, 1, 30]]
TOKENS = [5, 12, 44, 0, 7, 33, 21, 19, 48, 2, 10, 27]
CONFIGS = {"llama": llama_config, "gpt2": gpt2_config, "mixtral": mixtral_config}


@torch.no_grad()
def sequence_logits(model, tokens: list[int], use_cache: bool) -> torch.Tensor:
    """fp32 ``[s, V]`` logits of every position of ``tokens``: in one forward, or with
    the cache one token at a time (each from the cached keys of the earlier ones); under
    tensor parallelism gathered over ``model.ps.tp``, under pipeline parallelism
    broadcast from the last stage (every rank gets all of them)."""
    model.eval()
    ids = torch.tensor([tokens], dtype=torch.int64, device=next(model.parameters()).device)
    vocab = model.config.vocab_size
    if not use_cache:
        out = stage_forward(model, ids)
        local = None if out is None else out[0].float()  # [s, V_padded/tp]
    else:
        cache = InferenceCache(len(tokens))
        rows = []  # copies: a step's logits may live in storage the next step reuses
        for i in range(len(tokens)):
            out = stage_forward(model, ids[:, i:i + 1], inference_cache=cache)
            rows.append(None if out is None else out[0, -1].float().clone())
        local = None if rows[0] is None else torch.stack(rows)
    if local is not None:
        local = gather_from_tensor_model_parallel_region(local, model.ps.tp)[:, :vocab]
    return from_last_stage(model, local)


def save_checkpoints(tmp_path_factory) -> dict:
    """{family: checkpoint directory} of random-weight 2-layer models saved at tp=1
    (vocab 50, padded to 56 at tp=1 and 64 at tp=2)."""
    out = {}
    for family, make in CONFIGS.items():
        cfg = MegaliteConfig(model=make())
        model = GPTModel(cfg.model, single_process_state(), seed=1)
        root = str(tmp_path_factory.mktemp(family))
        save_full_model(cfg, _random_weights(model), root)
        out[family] = root
    return out


def run_layout(root: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None):
    """What this rank generates and computes at the layout (every rank gets the tokens
    and logits: they are shared from the last pipeline stage)."""
    ps = inference_state(tp, pp, ep, etp)
    _, model = load_model(root, None, ps)
    torch.manual_seed(0)
    layers = sorted(int(i) for i in model.decoder.layers)
    cache = InferenceCache(len(TOKENS))
    with torch.no_grad():
        stage_forward(model, torch.tensor([TOKENS[:4]]), inference_cache=cache)
    groups = cache.layer(layers[0]).k.shape[2]  # this rank's: [max_len, b, ng/tp, d]
    return {
        "greedy": [generate(model, p, 10) for p in PROMPTS],
        "batch": generate_batch(model, PROMPTS, 10),
        "logits": sequence_logits(model, TOKENS, use_cache=True),
        "full": sequence_logits(model, TOKENS, use_cache=False),
        "cached_groups": groups,
        "stage_layers": layers,
        "padded_vocab": (model.output_weight().shape[0] * tp if model.post_process
                         else None),
    }


def on_rank(rank, world_size, root, tp, pp=1, ep=1, etp=None):
    return run_layout(root, tp, pp, ep, etp)


def check_equal(one: dict, ranks: list[dict], family: str, tp: int) -> None:
    """Every rank generated one process's tokens (single prompts and the batch), its
    logits (cached and full forward) within 1e-4 of one process's."""
    cfg = CONFIGS[family]()
    groups = cfg.num_query_groups or cfg.num_attention_heads
    assert one["cached_groups"] == groups and one["padded_vocab"] == 56
    for rank in ranks:
        assert rank["cached_groups"] == groups // tp
        assert rank["padded_vocab"] in (None, 56 if tp == 1 else 64)
        assert rank["greedy"] == one["greedy"]
        assert rank["batch"] == one["greedy"]
        assert rank["logits"].shape == one["logits"].shape == (len(TOKENS), 50)
        assert (rank["logits"] - one["logits"]).abs().max().item() < 1e-4
        assert (rank["full"] - one["logits"]).abs().max().item() < 1e-4
    assert any(len(set(g)) > 1 for g in one["greedy"])  # not a constant output


def put_json(url: str, body, method: str = "PUT", timeout: float = 60) -> tuple[int, dict]:
    """(status, JSON answer) of an HTTP request with ``body`` (JSON-encoded unless bytes),
    error statuses included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
