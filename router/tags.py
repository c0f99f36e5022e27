"""What a text parser holds back of a stream: the end of the text so far that may be the
beginning of a tag (``<tool_call>``, ``</think>``) its next piece completes."""

from __future__ import annotations


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag``."""
    if text[-1:] not in tag[:-1] or not text:  # (what most pieces of text are: at once)
        return 0
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
