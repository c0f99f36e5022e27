import os
import signal
import socket
import subprocess
import sys

from common.model_info import made_model_dir
from engine.models.maker import ensure_model


def test_a_killed_makers_directory_goes_with_the_next_make(tmp_path, monkeypatch):
    """A maker SIGKILLed mid-make leaves its temporary directory (and releases the lock
    with its process); the next ``ensure_model`` makes the model and removes it."""
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    target = made_model_dir("llama", "tiny")
    # A maker that stops for good inside make_model, as a SIGKILL would find it.
    script = (
        "import os, signal\n"
        "import engine.models.maker as maker\n"
        "maker.make_model = lambda *args: os.kill(os.getpid(), signal.SIGKILL)\n"
        "maker.ensure_model('llama', 'tiny')\n"
    )
    env = {**os.environ, "PDSERVE_HOME": str(tmp_path)}
    killed = subprocess.Popen([sys.executable, "-c", script], env=env)
    killed_pid = killed.pid
    assert killed.wait(120) == -signal.SIGKILL
    left = list(target.parent.glob(f".{target.name}-{socket.gethostname()}-{killed_pid}-*"))
    assert len(left) == 1 and left[0].is_dir() and not target.exists()
    another_hosts = target.parent / f".{target.name}-elsewhere-1-abc"  # theirs to remove
    another_hosts.mkdir()
    assert ensure_model("llama", "tiny") == target
    assert (target / "config.json").exists()
    assert sorted(p for p in target.parent.iterdir() if p.is_dir()) == [another_hosts, target]
    assert not left[0].exists()
