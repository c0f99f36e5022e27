"""Client keys from PDSERVE_API_KEYS, added to the config's (rendered deployments give
them only this way)."""

from __future__ import annotations

import pytest

from common.api_keys import api_keys_from_env
from common.config import PdserveConfig
from common.config_base import ConfigError
from common.config_loader import build
from router.main import with_env_api_keys


def test_keys_are_split_on_commas_and_whitespace_and_join_the_configs():
    assert api_keys_from_env({}) == [] and api_keys_from_env({"PDSERVE_API_KEYS": " "}) == []
    assert api_keys_from_env({"PDSERVE_API_KEYS": "a1, b2\nc3,,"}) == ["a1", "b2", "c3"]
    config = build(PdserveConfig, {"router": {"api_keys": ["k0"]}})
    assert with_env_api_keys(config, {}) is config
    keyed = with_env_api_keys(config, {"PDSERVE_API_KEYS": "k1,k2"})
    assert keyed.router.api_keys == ["k0", "k1", "k2"] and config.router.api_keys == ["k0"]
    with pytest.raises(ConfigError, match="printable ASCII"):
        api_keys_from_env({"PDSERVE_API_KEYS": "clé"})
