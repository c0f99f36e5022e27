"""An EAGLE-3 head through a real ``pdserve up`` stack (router + 1 prefill + 1 decode
worker, ``engine.speculative_method: eagle3``, the oracle head over a bigram target):
every request is disaggregated (one more cache layer through the connector), the decode
worker keeps every draft, and the client gets exactly the tokens of the offline engine
without drafts, whole or streamed. (The oracle attends only to its own position, so
whether the prompt's head KV arrived is the engine test's to see:
``test_eagle3.test_the_heads_kv_moves_with_the_prompts_blocks``.)"""

from __future__ import annotations

import pytest

from benchmarks.draft_model import bigram_checkpoint
from benchmarks.eagle3 import oracle_eagle3_head
from engine import LLM
from tests.router.test_draft_model_live import (
    assert_drafts_kept_and_tokens_offline,
    drafting_stack,
)

MODEL = "eagle"


@pytest.fixture(scope="module")
def target_and_stack(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eagle3")
    target = bigram_checkpoint(tiny_llama, tmp / "target")
    head = oracle_eagle3_head(target, tmp / "head")
    with drafting_stack(tmp, target, "eagle3", head, MODEL) as stack:
        yield target, stack


def test_every_draft_is_kept_and_the_tokens_are_the_engines(target_and_stack):
    target, stack = target_and_stack
    assert_drafts_kept_and_tokens_offline(stack, MODEL, LLM(target))
