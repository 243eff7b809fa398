"""tools/evaluate.py prints the training loop's validation loss at the checkpoint's
iteration; tools/generate.py runs on that checkpoint; bad input is one clear error."""

import math
import os
import re

import pytest

from tests.tools import REPO, load_tool
from tests.training.common import run_training, tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    cfg = tiny_config(train={"train_iters": 8, "eval_interval": 4, "eval_iters": 2},
                      checkpoint={"save": root, "save_interval": 8})
    result, _ = run_training(cfg)
    return root, result.valid_losses


def test_evaluate_equals_training_loop(trained, capsys):
    root, valid_losses = trained
    assert sorted(valid_losses) == [4, 8]
    assert load_tool("evaluate").main(["--load", root, "--no-progress"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.search(r"iteration 8 \| lm loss value: (\S+) \| lm loss PPL: (\S+) \| tokens: 256",
                  line)
    assert m, line
    loss = float(m.group(1))
    assert abs(loss - valid_losses[8]) < 1e-5 * valid_losses[8]
    assert abs(float(m.group(2)) - math.exp(loss)) < 1e-4 * math.exp(loss)
    assert 3.5 < loss < 4.5  # near ln(61): 8 iterations barely move a random model


def test_evaluate_counts_micro_batches_in_a_log(trained, capsys, monkeypatch):
    """stderr not a terminal (a SLURM log): a few plain lines, not a bar."""
    monkeypatch.setenv("MEGALITE_PROGRESS_DELAY", "0")
    assert load_tool("evaluate").main(["--load", trained[0]]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("evaluate")]
    assert lines[0].startswith("evaluate: 12% (1/8 micro-batches, ")
    assert [line.split(" (")[0] for line in lines[1:]] == \
        [f"evaluate: {p}%" for p in (25, 38, 50, 62, 75, 88, 100)]


def test_generate_tool_and_bad_input(trained, capsys, tmp_path):
    root, _ = trained
    (tmp_path / "a_file").write_text("not a checkpoint")
    generate = load_tool("generate")
    assert generate.main(["--load", root, "--prompt", "5 9 12", "--max-new-tokens", "6",
                          "--temperature", "0"]) == 0
    out = capsys.readouterr().out.strip()
    prompt, rest = out.split("]")
    assert prompt == "[5 9 12" and 1 <= len(rest.split()) <= 6
    assert all(0 <= int(t) <= 60 for t in rest.split())
    cases = [
        (["--load", str(tmp_path), "--prompt", "1"], 4, "holds no megalite checkpoint"),
        (["--load", root, "--prompt", " ".join(["1"] * 16)], 2, "sequence length is 16"),
        (["--load", root, "--prompt", "1", "--top-p", "2"], 2, "top-p must be in"),
        (["--load", root, "--prompt", "1", "--tokenizer-type", "GPT2BPETokenizer"], 3,
         "GPT2BPETokenizer needs --vocab-file"),
        (["--load", root, "--prompt", "1", "--tokenizer-type", "GPTSentencePieceTokenizer",
          "--tokenizer-model", str(REPO / "data" / "kjv_bpe_8k.model")], 3,
         "has 8000 tokens but the checkpoint's model has a vocabulary of 61; pass the "
         "tokenizer the model was trained with"),
        (["--load", str(tmp_path / "a_file"), "--prompt", "1"], 4,
         "a_file is a file, not a checkpoint directory"),
        (["--load", root, "--prompt", "1", "--tensor-model-parallel-size", "2"], 2,
         "--tensor-model-parallel-size 2 needs 2 processes, this run has 1; launch with "
         "torchrun --nproc-per-node 2"),
        (["--load", root, "--prompt", "1", "--pipeline-model-parallel-size", "2"], 2,
         "--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 2 needs 2 "
         "processes, this run has 1; launch with torchrun --nproc-per-node 2"),
        (["--load", root, "--prompt", "1", "--context-parallel-size", "2"], 2,
         "--context-parallel-size 2: inference runs tensor, pipeline and expert parallel"),
    ]
    for argv, code, message in cases:
        assert generate.main(argv) == code, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("generate: error: ") and "\n" not in err, err
        assert message in err
    assert load_tool("evaluate").main(["--load", str(tmp_path / "nope")]) == 4
    assert "does not exist" in capsys.readouterr().err


def test_evaluate_jsonl(trained, capsys, tmp_path):
    import json

    import torch
    import torch.nn.functional as F

    from megalite.checkpoint.consolidated import load_full_model

    root, _ = trained
    docs = [" ".join(str((7 * i + j) % 60) for j in range(5 + i)) for i in range(12)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + "not json\n")
    assert load_tool("evaluate").main(["--load", root, "--jsonl", str(path),
                                       "--no-progress"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # 12 documents of 5..16 ids, each + eod: 138 tokens -> 8 samples of 16 (128 tokens)
    m = re.search(r"lm loss value: (\S+) .* tokens: 128$", line)
    assert m, line
    stream = [t for d in docs for t in [*map(int, d.split()), 60]][:129]
    ids = torch.tensor(stream)
    _, model = load_full_model(root)
    with torch.no_grad():
        logits = model.eval()(ids[:-1].view(8, 16))[..., :61]
    want = F.cross_entropy(logits.reshape(-1, 61), ids[1:]).item()
    assert abs(float(m.group(1)) - want) < 1e-5 * want
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "1 2"}\n')
    assert load_tool("evaluate").main(["--load", root, "--jsonl", str(empty)]) == 2
    assert "make no sample of 17 tokens" in capsys.readouterr().err


def _evaluate_on_rank(rank, world_size, root, flag):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = load_tool("evaluate").main(["--load", root, "--no-progress", flag,
                                           str(world_size)])
    return code, out.getvalue()


@pytest.mark.parametrize("flag", ["--tensor-model-parallel-size",
                                  "--pipeline-model-parallel-size"])
def test_evaluate_at_tp2_and_pp2(trained, flag):
    """The checkpoint (saved at tp=1) evaluated at tp=2, and at pp=2 (the last stage's
    loss broadcast to stage 0): rank 0 prints the training loop's validation loss, rank 1
    nothing."""
    from tests.distributed.harness import run_distributed

    root, valid_losses = trained
    (code0, out0), (code1, out1) = run_distributed(2, _evaluate_on_rank, root, flag)
    assert code0 == code1 == 0 and out1 == ""
    loss = float(re.search(r"iteration 8 \| lm loss value: (\S+) ", out0).group(1))
    assert abs(loss - valid_losses[8]) < 1e-5 * valid_losses[8]


def test_server_tool_on_an_os_chosen_port(trained):
    """tools/run_text_generation_server.py as users start it (--port 0: the OS picks),
    answered by a real HTTP client: greedy equals tools/generate.py's tokens, and limits
    from its flags."""
    import json
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from megalite.inference.generation import generate
    from megalite.inference.loading import load_for_inference

    root, _ = trained
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "run_text_generation_server.py"), "--load", root,
         "--port", "0", "--max-prompts", "2", "--max-request-bytes", "500"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "MEGALITE_PROGRESS_DELAY": "0"})
    try:
        line = proc.stdout.readline()
        m = re.match(r"serving PUT (http://127\.0\.0\.1:(\d+)/api)$", line.strip())
        assert m and int(m.group(2)) > 0, (line, proc.stderr.read() if proc.poll() else "")

        def put(body):
            req = urllib.request.Request(m.group(1), data=json.dumps(body).encode(),
                                         method="PUT")
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        code, out = put({"prompts": ["5 9 12", "7"], "tokens_to_generate": 4,
                         "temperature": 0})
        _, model, tok = load_for_inference(root)
        assert code == 200
        assert out["tokens"] == [[5, 9, 12] + generate(model, [5, 9, 12], 4, eod=tok.eod),
                                 [7] + generate(model, [7], 4, eod=tok.eod)]
        assert put({"prompts": ["1"] * 3}) == (400, {"error": "at most 2 prompts per "
                                                              "request, got 3"})
        assert put({"prompts": ["1" * 600]})[0] == 413
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # its start, counted on a piped stderr (a log): what it begins with, then each step
    steps = [line for line in proc.stderr.read().splitlines()
             if line.startswith("server start: ")]
    assert steps[0] == "server start: 0% (0/4 steps, 0 s), starting the ranks"
    assert [line.split(" (")[0] for line in steps[1:]] == [
        "server start: 25%", "server start: 50%", "server start: 75%", "server start: 100%"]


class _Port:
    """stdout of the server's rank 0: sets ``ready`` once it prints its address."""

    def __init__(self):
        import threading

        self.text, self.ready = "", threading.Event()

    def write(self, text):
        self.text += text
        if "serving PUT" in self.text:
            self.ready.set()
        return len(text)

    def flush(self):
        pass


def _serve_on_rank(rank, world_size, root, flag):
    """Every rank runs the server tool; on rank 0 a client thread sends a bad request,
    then a good one, then SIGTERM to this process (the tool's main is in this thread)."""
    import contextlib
    import json
    import os
    import signal
    import threading
    import urllib.error
    import urllib.request

    argv = ["--load", root, "--port", "0", flag, str(world_size)]
    server = load_tool("run_text_generation_server")
    if rank != 0:
        return server.main(argv), None
    out, answers = _Port(), []

    def client():
        try:
            assert out.ready.wait(120), out.text
            url = re.search(r"serving PUT (\S+)", out.text).group(1)
            for body in ({"prompts": ["5 9 12", ""], "tokens_to_generate": 4},
                         {"prompts": ["5 9 12", "7"], "tokens_to_generate": 4,
                          "temperature": 0},
                         {"prompts": ["3 4"], "tokens_to_generate": 5, "top_k": 5,
                          "random_seed": 11}):
                req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                             method="PUT")
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        answers.append((r.status, json.loads(r.read())))
                except urllib.error.HTTPError as e:
                    answers.append((e.code, json.loads(e.read())))
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client)
    thread.start()
    with contextlib.redirect_stdout(out):
        code = server.main(argv)
    thread.join()
    return code, answers


@pytest.mark.parametrize("flag", ["--tensor-model-parallel-size",
                                  "--pipeline-model-parallel-size"])
def test_server_on_two_ranks(trained, flag):
    """The server tool at tp 2 and at pp 2, answered by a real HTTP client: a bad request
    is refused on rank 0 (rank 1 never sees it), good ones equal one process's
    generation, and SIGTERM to rank 0 stops both ranks cleanly (exit 0)."""
    import torch

    from megalite.inference.generation import generate
    from megalite.inference.loading import load_for_inference
    from megalite.inference.sampling import SamplingParams
    from tests.distributed.harness import run_distributed

    root, _ = trained
    (code0, answers), (code1, _) = run_distributed(2, _serve_on_rank, root, flag)
    assert code0 == code1 == 0
    assert answers[0] == (400, {"error": "prompts[1] has no tokens; an empty prompt needs "
                                         "add_BOS true"})
    _, model, tok = load_for_inference(root)
    assert answers[1][0] == 200
    assert answers[1][1]["tokens"] == [[5, 9, 12] + generate(model, [5, 9, 12], 4, eod=tok.eod),
                                       [7] + generate(model, [7], 4, eod=tok.eod)]
    sampled = generate(model, [3, 4], 5, SamplingParams(1.0, 5), eod=tok.eod,
                       generator=torch.Generator().manual_seed(11))
    text = tok.detokenize([3, 4] + [t for t in sampled if t != tok.eod])
    assert answers[2][0] == 200 and answers[2][1]["text"] == [text]
    assert answers[2][1]["tokens"] == [[3, 4] + sampled]
    assert "".join(answers[2][1]["segments"][0]) == text
