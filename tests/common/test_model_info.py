"""What the router reads of the model and the config: the tightest length limit of the roles
that run, and the block size the workers use."""

from __future__ import annotations

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
