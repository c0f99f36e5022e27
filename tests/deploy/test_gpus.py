"""``pdserve up`` on a host with GPUs: each worker sees its own tensor_parallel_size GPUs."""

from __future__ import annotations

from common.config import Role
from common.config_loader import load_config
from deploy.gpus import visible_gpus
from deploy.up import Stack
from tests.deploy.test_render import DEMO


def test_each_worker_sees_its_own_gpus(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7,9")
    assert visible_gpus() == ["3", "5", "7", "9"]
    config = load_config(str(DEMO), ["engine.tensor_parallel_size=2"])
    env = _gpu_env(config, tmp_path)
    assert env == {
        (Role.PREFILL, 0): {"CUDA_VISIBLE_DEVICES": "3,5"},
        (Role.DECODE, 0): {"CUDA_VISIBLE_DEVICES": "7,9"},
    }
    crowded = load_config(str(DEMO), ["engine.tensor_parallel_size=4"])
    env = _gpu_env(crowded, tmp_path)
    assert env[(Role.DECODE, 0)] == {"CUDA_VISIBLE_DEVICES": "3,5,7,9"}  # shares, and says so
    assert "the workers need 8 GPUs, 4 are visible" in capsys.readouterr().out


def test_no_gpus_no_assignment(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _gpu_env(load_config(str(DEMO)), tmp_path) == {}


def _gpu_env(config, log_dir):
    stack = Stack(config, log_dir)
    stack.config_path.unlink()  # the resolved config it writes for its children
    return stack._gpu_env()


def test_a_worker_needing_more_gpus_than_the_host_has_is_refused(monkeypatch, tmp_path, capsys):
    """Its ranks would share a GPU (NCCL refuses): an error before anything starts."""
    import pytest

    from common.config_base import ConfigError
    from deploy.cli import main
    from deploy.gpus import worker_gpus

    config = load_config(str(DEMO), ["engine.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="a prefill worker needs 2 GPUs; the host has 1"):
        worker_gpus(config, 1)
    args = ["deploy", "compose", "--config", str(DEMO), "--variant", "cuda", "--gpus", "1",
            "--set", "engine.tensor_parallel_size=2"]  # fmt: skip
    assert main(args) == 2
    assert "needs 2 GPUs; the host has 1" in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    assert main(["up", "--config", str(DEMO), "--set", "engine.tensor_parallel_size=2",
                 "--set", f"model={tmp_path}"]) == 2  # fmt: skip
    assert "needs 2 GPUs; the host has 1" in capsys.readouterr().err
