"""The engine's request checks alone: each refuses what it must, naming the parameter,
and passes the nearest request that is fine."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.pooling import EMBEDDING_SAMPLING, PoolingParams
from engine.request import RemoteKV
from engine.request_checks import check_pooling, check_remote_kv, check_resume, check_sampling
from engine.sampling_params import SamplingParams

VOCAB = 8
EOS = frozenset({7})


def refused_param(check, *args, **kwargs) -> str | None:
    try:
        check(*args, **kwargs)
    except InvalidRequestError as exc:
        return exc.param
    return None


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(stop_token_ids=[7]), None),
        (SamplingParams(stop_token_ids=[8]), "stop_token_ids"),
        (SamplingParams(logit_bias={8: 1.0}), "logit_bias"),
        (SamplingParams(bad_words_token_ids=[[1, 8]]), "bad_words"),
        (SamplingParams(min_tokens=2, stop_token_ids=list(range(7))), "stop_token_ids"),
        (SamplingParams(min_tokens=2, stop_token_ids=list(range(6))), None),
        (
            SamplingParams(min_tokens=2, allowed_token_ids=[1, 7], stop_token_ids=[1]),
            "allowed_token_ids",
        ),
        (SamplingParams(n=2), "n"),
    ],
)
def test_sampling(params, param):
    assert refused_param(check_sampling, params, VOCAB, EOS) == param


def test_pooling():
    kw = dict(model_name="m", generates=True, vocab_size=VOCAB, computes_here=True)
    assert refused_param(check_pooling, None, SamplingParams(), **kw) is None
    assert refused_param(check_pooling, None, SamplingParams(), **kw | {"generates": False}) \
        == "model"  # fmt: skip
    assert refused_param(check_pooling, PoolingParams(), EMBEDDING_SAMPLING, **kw) is None
    assert refused_param(check_pooling, PoolingParams(), SamplingParams(), **kw) == "pooling"
    assert refused_param(check_pooling, PoolingParams(), EMBEDDING_SAMPLING,
                         **kw | {"computes_here": False}) == "pooling"  # fmt: skip
    scored = PoolingParams(token_ids=(1, VOCAB))
    assert refused_param(check_pooling, scored, EMBEDDING_SAMPLING, **kw) == "pooling"
    embedder = kw | {"generates": False}
    assert refused_param(check_pooling, PoolingParams(), EMBEDDING_SAMPLING, **embedder) is None
    assert refused_param(check_pooling, PoolingParams(token_ids=(1,)), EMBEDDING_SAMPLING,
                         **embedder) == "pooling"  # fmt: skip


def test_resume():
    params = SamplingParams(max_tokens=3)
    assert refused_param(check_resume, 10, 0, params, 10) is None  # nothing resumed
    assert refused_param(check_resume, 10, 2, params, 13) is None
    assert refused_param(check_resume, 10, 3, params, 13) == "output_token_ids"
    assert refused_param(check_resume, 10, 3, SamplingParams(max_tokens=9), 20) is None
    assert refused_param(check_resume, 10, 3, params, 20) == "output_token_ids"


def test_remote_kv():
    prompt = list(range(9))
    kv = RemoteKV("t", 9, (4, 5, 6))
    kw = dict(block_size=4, can_pull=True)
    assert refused_param(check_remote_kv, kv, prompt, 1, SamplingParams(), **kw) is None
    assert refused_param(check_remote_kv, kv, prompt, 0, SamplingParams(), **kw) \
        == "output_token_ids"  # fmt: skip
    assert refused_param(check_remote_kv, kv, prompt, 1, SamplingParams(),
                         **kw | {"can_pull": False}) == "kv"  # fmt: skip
    assert refused_param(check_remote_kv, RemoteKV("t", 9, (4, 5)), prompt, 1,
                         SamplingParams(), **kw) == "kv"  # fmt: skip
    assert refused_param(check_remote_kv, kv, prompt, 1, SamplingParams(prompt_logprobs=1),
                         **kw) == "prompt_logprobs"  # fmt: skip
