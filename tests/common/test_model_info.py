"""What the router reads of the model and the config: the tightest length limit of the roles
that run, the block size the workers use, and the names of the LoRA adapters."""

from __future__ import annotations

import json
import shutil

import pytest

from common.config_base import ConfigError
from common.config_loader import load_config
from common.hf_config import eos_token_ids, read_text_config
from common.model_info import model_info
from common.tokenizer import Tokenizer


def test_per_role_engine_overrides_reach_the_router(tiny_llama):
    base = [f"model={tiny_llama}", "engine.block_size=32", "engine.num_blocks=512"]
    info = model_info(load_config(None, base))
    assert info.block_size == 32 and info.max_model_len == 4096  # the checkpoint's limit
    info = model_info(load_config(None, [*base, "decode.engine.max_model_len=1024"]))
    assert info.max_model_len == 1024  # a decode worker could hold no longer request
    colocated = [*base, "prefill.replicas=0", "prefill.engine.max_model_len=512"]
    assert model_info(load_config(None, colocated)).max_model_len == 4096  # no prefill runs


def test_lora_adapter_names_are_checked(tiny_llama):
    base = [f"model={tiny_llama}"]
    info = model_info(load_config(None, [*base, "lora.adapters={alice: /a, bob.v2: /b}"]))
    assert info.served_name == tiny_llama.name
    for bad in ("lora.adapters={'a b': /a}", "lora.adapters={-a: /a}", "lora.adapters={a: ''}"):
        with pytest.raises(ConfigError, match="lora.adapters"):
            load_config(None, [*base, bad])
    # "model" must name one thing: the served model's name is no adapter's
    with pytest.raises(ConfigError, match="lora.adapters.m: is also router.served_model_name"):
        load_config(None, [*base, "router.served_model_name=m", "lora.adapters={m: /a}"])
    clash = load_config(None, [*base, f"lora.adapters={{{tiny_llama.name}: /a}}"])
    with pytest.raises(ConfigError, match="is also the served model's name"):
        model_info(clash)


def test_the_router_reads_the_eos_ids_the_engine_stops_at(tiny_llama, tmp_path):
    """The tokenizer's EOS (``</s>``, 2, here), then generation_config.json's list, which
    wins over config.json's id (as for the engine); an id past the vocabulary is dropped
    by both."""
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    config = read_text_config(tmp_path)
    vocab = int(config["vocab_size"])
    generation = {"eos_token_id": [7, 9, vocab + 5]}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert eos_token_ids(config, tmp_path) == (2, 7, 9, vocab + 5)
    info = model_info(load_config(None, [f"model={tmp_path}"]))
    assert info.eos_token_ids == {2, 7, 9}
    (tmp_path / "generation_config.json").unlink()
    assert model_info(load_config(None, [f"model={tmp_path}"])).eos_token_ids == {
        config["eos_token_id"]
    }


def test_the_tokenizers_eos_ends_sequences_as_in_vllm(tiny_llama, tmp_path):
    """vLLM stops at the tokenizer's EOS as well as generation_config's (config.json's
    without one). A ChatML fine-tune's layout: ``<|im_end|>`` (4) the tokenizer's EOS,
    ``</s>`` (2) config.json's, no generation_config: 4 never stopped anything. Older
    checkpoints name it in special_tokens_map.json only, which was not read."""
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").unlink()
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    chatml = {**tokenizer_config, "eos_token": {"content": "<|im_end|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(chatml))
    config = read_text_config(tmp_path)
    assert eos_token_ids(config, tmp_path) == (4, 2)
    assert model_info(load_config(None, [f"model={tmp_path}"])).eos_token_ids == {4, 2}
    without = {k: v for k, v in tokenizer_config.items() if k not in ("eos_token", "bos_token")}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(without))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>"}))  # fmt: skip
    assert eos_token_ids(config, tmp_path) == (4, 2)
    tokenizer = Tokenizer(tmp_path)
    assert (tokenizer.bos_token, tokenizer.eos_token_id) == ("<s>", 4)
    # As transformers reads them: the map over the config, unless the config lists its
    # added tokens (saved by transformers >= 4.34), when the map is not read at all.
    from transformers import AutoTokenizer

    for extra in ({"eos_token": "</s>"}, {"added_tokens_decoder": {}}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**without, **extra}))
        expected = AutoTokenizer.from_pretrained(tmp_path)
        tokenizer = Tokenizer(tmp_path)
        assert (tokenizer.bos_token, tokenizer.eos_token) == (
            expected.bos_token, expected.eos_token)  # fmt: skip
    assert (tokenizer.bos_token, tokenizer.eos_token) == (None, None)
