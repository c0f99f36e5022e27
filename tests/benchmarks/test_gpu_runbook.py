"""The GPU runbook and its prepared call name files that exist: a device session is
rare and short, and a step that names a moved test file runs nothing (step 12 named
``test_qwen2_5_vl_images.py`` months after it was merged into another file)."""

from __future__ import annotations

import re

from tests.support.processes import ROOT

DOCUMENTS = ["benchmarks/GPU_RUNBOOK.md", "benchmarks/gpu_session.sh"]


def test_every_path_the_runbook_names_exists():
    named = set()
    for document in DOCUMENTS:
        text = (ROOT / document).read_text()
        named |= set(re.findall(r"\b(?:tests|benchmarks)/[\w/.-]+\.(?:py|sh|md)\b", text))
    assert len(named) > 5  # (the pattern still finds them)
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert missing == []
