import os
import socket
import subprocess
import sys
from pathlib import Path

from common.owned_paths import owner_tag, pid_alive, remove_dead_owners


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert not pid_alive(process.pid)
    return process.pid


def test_only_this_hosts_paths_of_dead_processes_are_removed(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = _dead_pid()
    gone_dir = tmp_path / f"pdserve-tp-{host}-{dead}-9x_q"  # mkdtemp's tail may start with a digit
    gone_dir.mkdir()
    (gone_dir / "replies").write_text("")
    gone_file = tmp_path / f"config-{host}-{dead}.yaml"
    gone_file.write_text("")
    kept = [
        tmp_path / f"pdserve-tp-{owner_tag()}-abc",  # ours: alive
        tmp_path / f"pdserve-tp-other-host-{dead}-abc",  # another host's pid
        tmp_path / f"pdserve-tp-{host}-x{dead}",  # not a pid
        tmp_path / f"pdserve-tp-{host}-",  # no pid at all
        tmp_path / f"pdserve-tpx-{host}-{dead}",  # another prefix
    ]
    for path in kept:
        path.mkdir()
    removed = remove_dead_owners(tmp_path, "pdserve-tp-")
    removed += remove_dead_owners(tmp_path, "config-", ".yaml")
    assert sorted(removed) == sorted([gone_dir, gone_file])
    assert not gone_dir.exists() and not gone_file.exists()
    assert all(path.exists() for path in kept)


def test_owner_tag_names_this_process() -> None:
    assert owner_tag() == f"{socket.gethostname()}-{os.getpid()}"
    assert pid_alive(os.getpid())
