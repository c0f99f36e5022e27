"""YAML text for humans: leaf lists and mappings inline, multi-line strings (an embedded
config file) as literal blocks rather than one long quoted line."""

from __future__ import annotations

from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    def represent_str(self, data: str) -> yaml.ScalarNode:
        style = "|" if "\n" in data else None
        return self.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    def represent_dict(self, data: dict) -> yaml.MappingNode:
        # A literal block cannot sit inside an inline mapping.
        multiline = any(isinstance(v, str) and "\n" in v for v in data.values())
        node = self.represent_mapping("tag:yaml.org,2002:map", data.items())
        if multiline:
            node.flow_style = False
        return node


_Dumper.add_representer(str, _Dumper.represent_str)
_Dumper.add_representer(dict, _Dumper.represent_dict)


def dump_all(documents: list[dict[str, Any]]) -> str:
    return yaml.dump_all(
        documents, Dumper=_Dumper, sort_keys=False, width=100, default_flow_style=None
    )
