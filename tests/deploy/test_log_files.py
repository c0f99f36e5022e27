"""The children's logs stay bounded: a full log is moved aside when its child (re)starts,
and a running child's full log is copied aside and truncated while the child keeps
appending to it (its next line lands at the start of the emptied file)."""

from __future__ import annotations

import subprocess
import sys
import time

from common.config_loader import load_config
from deploy import up
from deploy.log_files import cut_if_full, older_part, open_log
from deploy.up import Stack
from tests.deploy.test_render import DEMO


def test_a_full_log_is_moved_aside_when_its_child_starts(tmp_path):
    path = tmp_path / "decode-0.log"
    with open_log(path, max_bytes=100) as log:
        log.write(b"x" * 99)
    with open_log(path, max_bytes=100) as log:  # 99 < 100: appended to
        log.write(b"y")
    assert path.read_bytes() == b"x" * 99 + b"y" and not older_part(path).exists()
    with open_log(path, max_bytes=100) as log:
        log.write(b"new\n")
    assert path.read_bytes() == b"new\n"
    assert older_part(path).read_bytes() == b"x" * 99 + b"y"


def test_a_running_childs_full_log_is_cut_and_it_keeps_writing(tmp_path):
    """A child writing through its inherited append-mode descriptor, as ``pdserve up``'s
    children do."""
    path = tmp_path / "prefill-0.log"
    code = "import sys, time\nfor i in range(400):\n    print(i, flush=True); time.sleep(0.005)"
    with open_log(path) as log:
        child = subprocess.Popen([sys.executable, "-c", code], stdout=log)
    cuts = 0
    while child.poll() is None:
        cuts += cut_if_full(path, max_bytes=200)
        time.sleep(0.02)
    cuts += cut_if_full(path, max_bytes=200)
    assert child.returncode == 0 and cuts >= 2
    live, older = path.read_bytes(), older_part(path).read_bytes()
    # No hole, no overwrite; the last line is live unless the last cut (after the exit,
    # on a busy host) moved it aside.
    assert not live.startswith(b"\0") and (older + live).endswith(b"399\n")
    numbers = [int(line) for line in (older + live).split()]
    assert numbers == sorted(numbers) and numbers[-1] == 399
    assert path.stat().st_size < 400 and older_part(path).stat().st_size < 400


def test_the_launcher_cuts_its_running_childrens_full_logs(tmp_path, monkeypatch):
    monkeypatch.setattr(up, "_LOG_CHECK_S", 0.0)
    stack = Stack(load_config(str(DEMO)), tmp_path, log_max_bytes=1000)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        stack.children = [("decode-0", proc)]
        stack._log("decode-0").write_bytes(b"z" * 1000)
        stack._cut_full_logs()
        assert stack._log("decode-0").read_bytes() == b""
        assert older_part(stack._log("decode-0")).read_bytes() == b"z" * 1000
    finally:
        proc.kill()
        proc.wait()
        stack.config_path.unlink()
