import os
import signal
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
    killed = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    left = list(target.parent.glob(f".{target.name}-*"))
    assert len(left) == 1 and left[0].is_dir() and not target.exists()
    assert ensure_model("llama", "tiny") == target
    assert (target / "config.json").exists()
    assert [p for p in target.parent.iterdir() if p.is_dir()] == [target]
    assert not left[0].exists()
