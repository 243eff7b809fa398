"""The body of a ``PUT /api`` request (Megatron-LM's text generation server fields), checked
field by field: :func:`parse_request` gives an :class:`ApiRequest` or raises
:class:`RequestError` (HTTP 400) with one line naming the field.

=============================  ==========================================================
field                          meaning (default)
=============================  ==========================================================
prompts                        non-empty list of strings (required)
tokens_to_generate             int in [0, limit] (64, or the limit when smaller); 0 scores
                               the prompts without generating
temperature, top_k, top_p      sampling (1.0, 0, 0.0); temperature 0 is greedy
random_seed                    int >= 0 (``--seed``'s default)
logprobs                       bool (false): answer each token's log-probability
top_n_logprobs                 int in [0, 20] (0): the n most likely tokens per position
add_BOS                        bool (false): put the tokenizer's bos first in each prompt
stop_token                     token id or null (null): generation ends after it
stop_on_eol                    bool (false): ends after a newline token
stop_on_double_eol             bool (false): ends after "\\n\\n" or two newlines in a row
prevent_newline_after_colon    bool (false): no newline token right after ":"
no_log                         bool (false): no log line for this request
beam_width, length_penalty     beam search: refused (not implemented)
=============================  ==========================================================
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from megalite.config import ConfigError
from megalite.config.run import DEFAULT_SEED
from megalite.inference.sampling import SamplingParams

FIELDS = ("prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "random_seed",
          "logprobs", "top_n_logprobs", "add_BOS", "stop_token", "stop_on_eol",
          "stop_on_double_eol", "prevent_newline_after_colon", "no_log")
BEAM_FIELDS = ("beam_width", "length_penalty")
FLAGS = ("logprobs", "add_BOS", "stop_on_eol", "stop_on_double_eol",
         "prevent_newline_after_colon", "no_log")
MAX_TOP_N_LOGPROBS = 20


@dataclass
class ServerLimits:
    """What one request may ask for (the tool's flags of the same names)."""

    max_request_bytes: int = 4 << 20   # --max-request-bytes
    max_prompts: int = 32              # --max-prompts (per request)
    max_tokens_to_generate: int | None = None  # --max-tokens-to-generate (None: seq length)
    max_concurrent_requests: int = 4   # --max-concurrent-requests (more: 503)

    def check(self) -> ServerLimits:
        for name in ("max_request_bytes", "max_prompts", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got "
                                  f"{getattr(self, name)}")
        if self.max_tokens_to_generate is not None and self.max_tokens_to_generate < 0:
            raise ConfigError(f"--max-tokens-to-generate must be >= 0, got "
                              f"{self.max_tokens_to_generate}")
        return self


class RequestError(ConfigError):
    """A request the server refuses; ``status`` is its HTTP code."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class ApiRequest:
    """One checked request body (the fields of the module docstring)."""

    prompts: list[str]
    tokens_to_generate: int
    params: SamplingParams
    seed: int
    logprobs: bool = False
    top_n_logprobs: int = 0
    add_BOS: bool = False          # noqa: N815 (Megatron's field name)
    stop_token: int | None = None
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    prevent_newline_after_colon: bool = False
    no_log: bool = False


def _shown(value) -> str:
    return json.dumps(value)[:40]


def _number(body: dict, key: str, default, kind, lo, hi):
    value = body.get(key, default)
    ok = (isinstance(value, int) if kind is int else isinstance(value, (int, float)))
    if not ok or isinstance(value, bool):
        raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}, "
                           f"got {_shown(value)}")
    if not lo <= value <= hi:
        raise RequestError(f"{key} must be in [{lo}, {hi}], got {value}")
    return kind(value)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, got {_shown(value)}")
    return value


def parse_request(body, max_tokens: int, limits: ServerLimits | None = None) -> ApiRequest:
    """The :class:`ApiRequest` of a request body (parsed JSON); raises
    :class:`RequestError` naming the bad field. ``max_tokens``: the model's sequence
    length. Token ids (``stop_token``) are checked against the vocabulary later, by the
    service that knows it."""
    limits = limits or ServerLimits()
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    beam = [key for key in BEAM_FIELDS if key in body]
    if beam:
        raise RequestError(f"beam search ({', '.join(beam)}) is not implemented; leave out "
                           f"beam_width and length_penalty to sample (temperature 0: "
                           f"greedy)")
    unknown = set(body) - set(FIELDS)
    if unknown:
        raise RequestError(f"unknown fields: {', '.join(sorted(unknown))[:200]} "
                           f"(known: {', '.join(FIELDS)})")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, str) for p in prompts):
        raise RequestError("prompts must be a non-empty list of strings")
    if len(prompts) > limits.max_prompts:
        raise RequestError(f"at most {limits.max_prompts} prompts per request, got "
                           f"{len(prompts)}")
    cap = max_tokens if limits.max_tokens_to_generate is None else min(
        max_tokens, limits.max_tokens_to_generate)
    new = _number(body, "tokens_to_generate", min(64, cap), int, 0, cap)
    params = SamplingParams(_number(body, "temperature", 1.0, float, 0.0, 100.0),
                            _number(body, "top_k", 0, int, 0, 1 << 30),
                            _number(body, "top_p", 0.0, float, 0.0, 1.0))
    seed = _number(body, "random_seed", DEFAULT_SEED, int, 0, 2**63 - 1)
    flags = {key: _flag(body, key) for key in FLAGS}
    top_n = _number(body, "top_n_logprobs", 0, int, 0, MAX_TOP_N_LOGPROBS)
    stop = body.get("stop_token")
    if stop is not None:
        stop = _number(body, "stop_token", None, int, 0, 2**31 - 1)
    return ApiRequest(prompts, new, params, seed, top_n_logprobs=top_n, stop_token=stop,
                      **flags)
