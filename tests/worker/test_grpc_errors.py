"""gRPC's own log lines, as a worker keeps them."""

from __future__ import annotations

import logging

from grpc._cython import cygrpc

from worker.grpc_errors import quiet_cancelled_writes


def _record(error: BaseException) -> logging.LogRecord:
    message = (
        "ExecuteBatchError raised in core by servicer method [/pdserve.v1.DecodeService/Generate]"
    )
    return logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "server.pyx", 710, message,
                             None, (type(error), error, None))  # fmt: skip


def test_a_write_after_the_client_cancelled_is_not_an_error(caplog):
    """A streaming handler's message written after its client cancelled: gRPC logged an
    ERROR with a traceback each time the router cancelled a decode stream (58 in a
    15-minute soak). It is DEBUG now; gRPC's other errors stay errors."""
    quiet_cancelled_writes()
    quiet_cancelled_writes()  # (once: a second call adds nothing)
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    assert len(grpc_log.filters) == 1
    sent = cygrpc.ExecuteBatchError(
        'Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation object at 0x1>,)'
    )
    other = cygrpc.ExecuteBatchError('Failed "execute_batch": (<ReceiveMessageOperation>,)')
    with caplog.at_level(logging.INFO, logger="grpc._cython.cygrpc"):
        grpc_log.handle(_record(sent))
        grpc_log.handle(_record(other))
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert "ReceiveMessageOperation" in str(caplog.records[0].exc_info[1])
    with caplog.at_level(logging.DEBUG, logger="grpc._cython.cygrpc"):
        grpc_log.handle(_record(sent))
    assert caplog.records[-1].levelname == "DEBUG"
