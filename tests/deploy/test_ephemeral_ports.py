"""Ports inside the OS's ephemeral range are warned about; the defaults sit below it."""

from __future__ import annotations

from common.config import PdserveConfig
from common.config_loader import build, load_config
from deploy.cli import main
from deploy.ephemeral_ports import ephemeral_port_warnings, ephemeral_range
from tests.deploy.test_config_check import EXAMPLES

LINUX_DEFAULT = range(32768, 61000)


def test_reads_the_range_file(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("32768\t60999\n")
    assert ephemeral_range(path) == LINUX_DEFAULT
    path.write_text("garbage\n")
    assert ephemeral_range(path) is None
    assert ephemeral_range(tmp_path / "missing") is None


def test_defaults_and_examples_lie_below_the_range():
    assert ephemeral_port_warnings(PdserveConfig(), LINUX_DEFAULT) == []
    for path in EXAMPLES:
        assert ephemeral_port_warnings(load_config(str(path)), LINUX_DEFAULT) == [], path


def test_each_owner_inside_the_range_is_named_with_its_ports():
    config = build(PdserveConfig, {"decode": {"replicas": 2, "port": 50200}})
    warnings = ephemeral_port_warnings(config, LINUX_DEFAULT)
    assert len(warnings) == 2
    assert warnings[0].startswith("decode.port (replica 0): ports 50200, 50201, 50202, 50203, ")
    assert warnings[1].startswith("decode.port (replica 1): ports 50210, ")
    assert "32768-60999" in warnings[0]
    assert ephemeral_port_warnings(config, None) == []


def test_config_check_warns_on_this_machine(tmp_path, capsys):
    ports = ephemeral_range()
    path = tmp_path / "layout.yaml"
    port = ports.start + 100 if ports else 50200
    path.write_text(f"decode: {{port: {port}}}\n")
    assert main(["config", "check", str(path)]) == 0
    err = capsys.readouterr().err
    assert ("lie in the OS's ephemeral range" in err) == (ports is not None)
