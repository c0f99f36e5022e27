"""What every benchmark record shares: where it ran (the CPU's model name; the GPU's comes
from torch), and Markdown files whose hand-written analysis survives a re-run, beside the
record's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NOTES_MARKER = "<!-- notes: hand-written, kept across runs -->"


def cpu_model() -> str | None:
    """The ``model name`` of /proc/cpuinfo; None where there is none (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> str:
    """Where a measurement ran: the GPU's name, else the CPU's and the torch threads."""
    import platform

    import torch  # here: the records' writers need no torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpu = cpu_model()
    return f"{cpu} ({torch.get_num_threads()} threads)" if cpu else platform.processor()


def write_markdown(path: Path, generated: str) -> None:
    """``generated`` followed by the notes marker and whatever the existing file held
    below it (nothing on the first run)."""
    notes = path.read_text().partition(NOTES_MARKER)[2] if path.exists() else ""
    notes = notes.rstrip() + "\n" if notes.strip() else "\n"
    path.write_text(generated.rstrip("\n") + "\n\n" + NOTES_MARKER + notes)


def write_record(stem: Path, record: dict[str, Any], markdown: str) -> None:
    """``<stem>.json`` (``record``) and ``<stem>.md`` (``markdown``, its notes kept)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    write_markdown(stem.with_suffix(".md"), markdown)


def rate_rows(rows: list[dict[str, Any]], num_tokens: int) -> list[str]:
    """Markdown table rows of timed cases (``case``, ``seconds``, ``vs_baseline``): the
    seconds, ``num_tokens`` a run per second, and the ratio to the baseline."""
    return [
        f"| {row['case']} | {row['seconds']:.3f} | {num_tokens / row['seconds']:,.0f} | "
        f"{row['vs_baseline']:.2f}x |"
        for row in rows
    ]
