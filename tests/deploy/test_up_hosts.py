"""``pdserve up`` and the configured hosts: a wildcard ``router.host`` is polled (and
shown) at its family's loopback, not at ``http://0.0.0.0:port``; an IPv6 one in
brackets; and a host that is none of this machine's addresses is named as the host,
once, without the "(another stack?)" that a port in use alone is."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from common.config_base import ConfigError
from common.config_loader import load_config
from common.listen_sockets import bind_listeners
from deploy.gpus import surely_no_cuda
from deploy.health_cmd import check_http
from deploy.up import Stack, _pool_problems, _wildcard_note, local_problems
from engine import LLM, SamplingParams
from tests.common.test_hosts import _serve_one_http_reply
from tests.support.polling import eventually
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats


@pytest.mark.parametrize(
    ("host", "root"),
    [
        ("0.0.0.0", "http://127.0.0.1:8000"),
        ("::", "http://[::1]:8000"),
        ("::1", "http://[::1]:8000"),
        ("localhost", "http://localhost:8000"),
    ],
)
def test_the_router_is_polled_where_this_machine_reaches_it(host, root, tmp_path):
    stack = Stack(load_config(None, [f"router.host='{host}'"]), tmp_path / "logs")
    try:
        assert stack.url_root == root
    finally:
        stack.config_path.unlink()


def test_a_router_on_every_ipv6_interface_answers_at_the_url_up_polls(tmp_path):
    (sock,) = bind_listeners("::", 0)  # (IPv6 only, as the router binds it)
    with sock:
        port = sock.getsockname()[1]
        config = load_config(None, ["router.host='::'", f"router.port={port}"])
        stack = Stack(config, tmp_path / "logs")
        stack.config_path.unlink()
        thread = _serve_one_http_reply(sock)
        healthy, line = check_http(f"{stack.url_root}/health", 5.0)
        assert healthy, line
        thread.join(5)
    note = _wildcard_note(config.router)
    assert note is not None and "every IPv6 interface" in note and f":{port}/v1" in note
    assert _wildcard_note(load_config(None, []).router) is None


def test_a_host_that_is_not_this_machines_is_named_as_the_host_once(tiny_llama, tmp_path):
    """Every bind failure said "(another stack?)": a router.host of another machine
    (Cannot assign requested address) too, once for each of a worker's five ports."""
    path = write_config(tmp_path / "config.yaml", tiny_llama)
    config = load_config(str(path), ["router.host=192.0.2.1", "prefill.host=192.0.2.1"])
    assert local_problems(config) == [
        "router.host: 192.0.2.1 is not an address of this machine (Cannot assign requested "
        "address)",
        "prefill.host: 192.0.2.1 is not an address of this machine (Cannot assign requested "
        "address)",
    ]


def _established_to(port: int) -> bool:
    """Whether some TCP connection over IPv6 (``/proc/net/tcp6``) is established to
    ``port`` on this machine."""
    for line in Path("/proc/net/tcp6").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
            return True
    return False


@pytest.mark.skipif(not Path("/proc/net/tcp6").exists(), reason="needs IPv6")
def test_a_stack_on_ipv6_addresses_serves_disaggregated(tiny_llama, tmp_path):
    """Router and workers on ::1, as in an IPv6-only cluster (worker hosts were refused:
    ZMQ's sockets and the NCCL store took IPv4 alone): the prompt's KV moves to the
    decode worker over NIXL, the reply is the offline engine's, and the router is
    subscribed to each worker's KV events over IPv6."""
    on_ipv6 = {"host": "::1"}
    config = write_config(tmp_path / "config.yaml", tiny_llama, prefill=on_ipv6,
                          decode=on_ipv6, router={**on_ipv6, "min_disagg_tokens": 0})  # fmt: skip
    prompt = "The quick brown fox jumps over the lazy dog " * 4
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (reference,) = LLM(tiny_llama).generate([prompt], params, use_tqdm=False)
    with serving(config, tmp_path / "home") as stack:
        assert stack.base_url.startswith("http://[::1]:")
        client = stack.openai_client()
        reply = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert reply.choices[0].model_extra["token_ids"] == reference.outputs[0].token_ids
        assert worker_stats(stack, "decode")[0].blocks_pulled > 0
        # (And the router's process exports no ``*_created`` series: ``router/main.py``.)
        exported = urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10).read()
        assert b"vllm:request_prompt_tokens_count" in exported and b"_created" not in exported
        loaded = load_config(str(config))
        for section in (loaded.prefill, loaded.decode):
            assert eventually(lambda s=section: _established_to(s.ports(0).events))


def test_what_a_worker_would_fail_on_later_is_said_before_anything_starts(tiny_llama, tmp_path):
    """A KV pool that cannot hold one request on a host without CUDA (``config check``
    can only warn: it may run elsewhere) and a LoRA adapter directory that is not here:
    each failed a worker 10-20 s after the start, the adapter's without naming its key."""
    path = write_config(tmp_path / "config.yaml", tiny_llama)
    small = load_config(str(path), ["engine.kv_cache_bytes=1000000"])
    (problem,) = _pool_problems(small, on_cpu=True)  # (both roles: said once)
    assert problem.startswith("engine.kv_cache_bytes: 1.0 MiB is 15 KV blocks, which cannot")
    assert _pool_problems(small, on_cpu=False) == []  # (a GPU host sizes it from its GPU)
    with pytest.raises(ConfigError, match="5000 is beyond the model's context") as error:
        load_config(str(path), ["decode.engine.max_model_len=5000"])  # (at load, then)
    assert error.value.key == "decode.engine.max_model_len"
    adapter = load_config(str(path), [f"lora.adapters={{alice: {tmp_path / 'none'}}}"])
    assert f"lora.adapters.alice: {tmp_path / 'none'} is no directory on this machine" in (
        local_problems(adapter)
    )


def test_a_host_surely_without_cuda_is_told_by_its_visible_devices(monkeypatch):
    """Only then are a CPU pool's problems errors: WSL2 lists no GPU under /proc (its
    /dev/dxg does), and a GPU host's workers would size their pools from the GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert surely_no_cuda()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert not surely_no_cuda()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    devices = (Path("/dev/nvidiactl"), Path("/dev/dxg"), Path("/proc/driver/nvidia/gpus"))
    assert surely_no_cuda() == (not any(path.exists() for path in devices))
