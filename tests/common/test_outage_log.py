"""An outage is said when it begins, reminded while it lasts, and said over when it ends."""

from __future__ import annotations

import logging
import time

from common.outage_log import OutageLog


def test_an_outage_is_said_once_reminded_and_said_over(caplog, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    outage = OutageLog(logging.getLogger("test.outage"), "registry unreachable", remind_s=60)
    with caplog.at_level(logging.INFO, logger="test.outage"):
        outage.succeeded()  # nothing to say
        for _ in range(30):  # a failure a second: said once, not 30 times
            outage.failed(ConnectionError("refused"))
            now[0] += 1
        now[0] += 31
        outage.failed(ConnectionError("refused"))  # past the reminder
        outage.succeeded()
        outage.succeeded()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "registry unreachable: refused",
        "registry unreachable for 61 s (31 failures): refused",
        "registry unreachable: over after 61.0 s (31 failures)",
    ]
