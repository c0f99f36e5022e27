"""``pdserve health``: one health probe, for container healthchecks and scripts.

    pdserve health --grpc HOST:PORT     a worker's grpc.health.v1: exit 0 when SERVING
    pdserve health --http URL           the router's /health: exit 0 on HTTP 200

Exit 1 otherwise (not ready, draining, unreachable), with one line saying why. Docker runs
a healthcheck every few seconds, so the probe also runs as ``python -m deploy.health_cmd``:
that skips building the whole CLI (whose other subcommands import torch).
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="a worker's gRPC address")
    target.add_argument("--http", metavar="URL", help="e.g. http://127.0.0.1:8000/health")
    parser.add_argument(
        "--service", default="", help="gRPC health service name ('' = the whole worker)"
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")


def check_grpc(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"{url}: HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except OSError as exc:
        return False, f"{url}: {exc}"
    except ValueError as exc:  # not a URL at all
        return False, f"{url}: {exc}"


def run(args: argparse.Namespace) -> int:
    if args.grpc:
        healthy, line = check_grpc(args.grpc, args.service, args.timeout)
    else:
        healthy, line = check_http(args.http, args.timeout)
    print(line, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


COMMAND = ("probe a worker (gRPC health) or the router (HTTP /health)", add_arguments, run)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m deploy.health_cmd")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
