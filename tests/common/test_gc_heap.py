"""freeze_startup_heap, in a process of its own (it changes the whole process): what is
alive when it is called leaves the collector's passes; garbage made after is collected."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import ROOT

SCRIPT = """
import gc, json, time
from common.gc_heap import freeze_startup_heap
startup = [[i] for i in range(200_000)]  # what a loaded worker holds, in small
gc.collect()
start = time.perf_counter(); gc.collect(); before_s = time.perf_counter() - start
frozen = freeze_startup_heap()
left = len(gc.get_objects())  # what a full pass still walks
start = time.perf_counter(); gc.collect(); after_s = time.perf_counter() - start
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
del a, b  # a reference cycle made after the freeze
print(json.dumps({"frozen": frozen, "left": left, "cycle_collected": gc.collect(),
                  "before_s": before_s, "after_s": after_s, "startup": len(startup)}))
"""


def test_startup_objects_leave_full_passes_and_later_garbage_is_still_collected():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["frozen"] > 200_000 and out["left"] < 1_000
    assert out["cycle_collected"] >= 2  # the two nodes (and their dicts)
    assert out["after_s"] < out["before_s"] / 10
