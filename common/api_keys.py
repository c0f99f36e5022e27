"""The router's client keys from the environment (``PDSERVE_API_KEYS``), beside the
config's ``router.api_keys``.

Rendered deployments never write keys into their files: a ConfigMap or a compose file is
read by whoever may read the deployment, and keys are secrets. Kubernetes gives the
router this variable from the optional Secret ``pdserve-api-keys`` (key ``keys``);
compose passes the host's. Keys are separated by commas or whitespace.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from common.config_base import ConfigError
from common.router_config import valid_api_key

API_KEYS_ENV = "PDSERVE_API_KEYS"
API_KEYS_SECRET = "pdserve-api-keys"  # Kubernetes: its key "keys" holds the list


def api_keys_from_env(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys ``PDSERVE_API_KEYS`` lists (none when unset or blank)."""
    keys = environ.get(API_KEYS_ENV, "").replace(",", " ").split()
    if not all(map(valid_api_key, keys)):
        raise ConfigError(API_KEYS_ENV, "keys must be printable ASCII")
    return keys
