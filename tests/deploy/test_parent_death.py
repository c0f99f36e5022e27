"""A child of ``pdserve up`` sets its own parent-death signal (no ``preexec_fn`` in the
launcher): it gets SIGTERM when its launcher dies, refuses to start if the launcher died
before it got that far, and does not hand the launcher's pid down to its own children."""

from __future__ import annotations

import os
import subprocess
import sys

from deploy.parent_death import PARENT_PID_ENV
from tests.support.polling import eventually
from tests.support.processes import is_running

CHILD = (
    "import time; from deploy.parent_death import term_with_parent; term_with_parent(); "
    "print('set', flush=True); time.sleep(60)"
)


def test_the_child_gets_sigterm_when_its_launcher_is_killed():
    # The launcher: starts the child naming itself, prints the child's pid, waits.
    launcher_code = (
        "import os, subprocess, sys, time\n"
        f"env = {{**os.environ, {PARENT_PID_ENV!r}: str(os.getpid())}}\n"
        f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}], env=env)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True
    )
    assert launcher.stdout is not None
    child_pid = int(launcher.stdout.readline())
    assert launcher.stdout.readline().strip() == "set"
    launcher.kill()
    launcher.wait()
    assert eventually(lambda: not is_running(child_pid), 10)


def test_a_child_whose_launcher_is_already_gone_does_not_start():
    """The launcher died before the child set its signal: the child has been reparented,
    its parent is not the pid it was given, and it refuses to start."""
    env = {**os.environ, PARENT_PID_ENV: "1" if os.getpid() != 1 else "2"}
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "config", "--help"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done
    assert "is gone; not starting" in done.stderr
    assert "usage" not in done.stdout


def test_the_launchers_pid_is_not_handed_down():
    """Tensor-parallel shards and other grandchildren watch their own parent. (In a
    process of its own: the signal it sets must not outlive the test.)"""
    code = (
        "import os; from deploy.parent_death import term_with_parent\n"
        f"os.environ[{PARENT_PID_ENV!r}] = str(os.getppid())\n"
        "term_with_parent(); term_with_parent()\n"  # the second: unset, nothing to do
        f"print(os.environ.get({PARENT_PID_ENV!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "None", done
