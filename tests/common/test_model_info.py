"""What the router reads of the model and the config: the tightest length limit of the roles
that run, the block size the workers use, and the names of the LoRA adapters."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from common.config_loader import load_config
from common.model_info import model_info


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
