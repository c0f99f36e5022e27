"""The offline API (``engine/llm.py``) as a vLLM script uses it: a batch all or none, the
text the router would give, vLLM's prompt dicts and stop reasons. Each ends with nothing
left in the engine."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.common import made_tokenizers


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama) as llm:
        yield llm


def test_a_bad_request_in_a_batch_leaves_none_of_it_queued(llm):
    """Checks only ``add_request`` makes (a stop id outside the vocabulary) failing on
    the second prompt left the first queued: run by the next ``generate``, for nobody."""
    greedy = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate(["hello", "world"], [greedy, SamplingParams(stop_token_ids=[999_999])],
                     use_tqdm=False)  # fmt: skip
    assert llm.engine.leak_report() == []
    (alone,) = llm.generate(["again"], greedy, use_tqdm=False)
    assert len(alone.outputs[0].token_ids) == 2 and llm.engine.leak_report() == []


def test_token_ids_given_beside_their_text_are_the_prompt(llm):
    """vLLM reads ``prompt_token_ids`` first; "prompt" beside them is their text. It was
    encoded again, and the ids given ignored."""
    ids = [1, 50, 60, 70]
    (out,) = llm.generate({"prompt_token_ids": ids, "prompt": "something else"},
                          SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)  # fmt: skip
    assert out.prompt_token_ids == ids and out.prompt == "something else"
    assert llm.engine.leak_report() == []


def test_a_completion_keeps_the_space_its_prompt_gave_it(tiny_llama, tmp_path):
    """A SentencePiece tokenizer (Llama 2, Mistral) strips the first space of what it
    decodes alone: " the" after a prompt came out "the" offline (the router, decoding
    after the prompt's last tokens as vLLM does, said " the")."""
    model = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = made_tokenizers.llama2_style(model)
    the = tokenizer.encode(" the", add_special_tokens=False)[-1]
    with LLM(model) as llm:
        params = SamplingParams(max_tokens=1, temperature=0, allowed_token_ids=[the])
        (out,) = llm.generate(["Hello world, this is"], params, use_tqdm=False)
        assert out.outputs[0].token_ids == [the] and out.outputs[0].text == " the"
        assert llm.engine.leak_report() == []


def test_generation_configs_other_eos_ids_stop_as_stop_tokens(tiny_llama, tmp_path):
    """vLLM makes generation_config's other EOS ids stop tokens: the completion's
    ``stop_reason`` is the id and its text is not in the output (it was None, and an EOS
    that is not a special token left its text)."""
    model = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, 50]}))
    with LLM(model) as llm:
        assert 50 not in llm.tokenizer.special_ids  # an ordinary token, with a text
        params = SamplingParams(max_tokens=4, temperature=0, logit_bias={50: 100})
        (out,) = llm.generate(["Hello"], params, use_tqdm=False)
        completion = out.outputs[0]
        assert (completion.token_ids, completion.finish_reason) == ([50], "stop")
        assert (completion.stop_reason, completion.text) == (50, "")
        assert llm.engine.leak_report() == []


def test_a_bad_generated_token_names_its_field(llm):
    """A token id outside the vocabulary among the tokens generated elsewhere was
    reported as a bad prompt ("prompt token ids", param prompt)."""
    with pytest.raises(InvalidRequestError) as error:
        llm.engine.add_request("x", [5, 6], SamplingParams(max_tokens=4),
                               output_token_ids=[10**6])  # fmt: skip
    assert error.value.param == "output_token_ids" and "output_token_ids" in error.value.message
    assert llm.engine.leak_report() == []


def test_a_stop_string_ends_the_sequence_where_it_appears(llm):
    """vLLM's ``SamplingParams(stop=...)``: the engine stops generating at the token that
    completes the string (it is not run to max_tokens and cut after), the text ends
    before it (or with it: ``include_stop_str_in_output``), the stop reason is the
    string. The offline API had no stop strings."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    (free,) = llm.generate(["Hello world"], greedy, use_tqdm=False)
    text, token_ids = free.outputs[0].text, free.outputs[0].token_ids
    start = next(i for i in range(4, len(text) - 3) if text.index(text[i : i + 3]) == i)
    stop = text[start : start + 3]
    for include in (False, True):
        params = dataclasses.replace(greedy, stop=["never there", stop],
                                     include_stop_str_in_output=include)  # fmt: skip
        (out,) = llm.generate(["Hello world"], params, use_tqdm=False)
        completion = out.outputs[0]
        assert completion.text == text[: start + (3 if include else 0)]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        kept = completion.token_ids
        assert kept == token_ids[: len(kept)] and len(kept) < len(token_ids)
        assert llm.engine.leak_report() == []


def test_n_samples_of_a_prompt_are_its_seeded_sequences(llm):
    """vLLM's ``n``: one output per prompt with n completions (index 0..n-1); sample i
    seeded as the router seeds it (the seed + i), so a seeded run is reproducible and
    sample 0 is the n=1 run's."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3)
    first, second = llm.generate(["Hello", "Other prompt"], params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1, 2] and len(second.outputs) == 3
    assert first.request_id != second.request_id
    for index, completion in enumerate(first.outputs):
        alone = dataclasses.replace(params, n=1, seed=7 + index)
        (single,) = llm.generate(["Hello"], alone, use_tqdm=False)
        assert single.outputs[0].token_ids == completion.token_ids
        assert single.outputs[0].text == completion.text
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert llm.engine.leak_report() == []


def test_an_engine_request_refuses_what_only_the_offline_api_reads(llm):
    """The engine runs one sequence and reads no text: n and stop strings given to it
    were silently ignored."""
    for params, param in ((SamplingParams(n=2), "n"), (SamplingParams(stop="x"), "stop")):
        with pytest.raises(InvalidRequestError) as error:
            llm.engine.add_request("x", [5, 6], params)
        assert error.value.param == param
    assert llm.engine.leak_report() == []


def test_the_tokenizers_eos_stops_a_sequence(tiny_llama, tmp_path):
    """A ChatML fine-tune's layout (``<|im_end|>`` the tokenizer's EOS, ``</s>``
    config.json's, no generation_config): vLLM stops at ``<|im_end|>``; the engine ran on
    to max_tokens ("<|im_end|>" 5 times, finish_reason length)."""
    model = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    (model / "generation_config.json").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    with LLM(model) as llm:
        params = SamplingParams(max_tokens=5, temperature=0, logit_bias={4: 100})
        (out,) = llm.generate(["Hello"], params, use_tqdm=False)
        completion = out.outputs[0]
        assert (completion.token_ids, completion.finish_reason) == ([4], "stop")
        assert (completion.stop_reason, completion.text) == (None, "")
        assert llm.engine.leak_report() == []
