"""Config validation before anything starts: the example configs pass, broken configs fail
with the key named, through ``pdserve config check|show`` and the worker entry point."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.config_loader import build, load_config, to_dict
from deploy.cli import main
from tests.support.processes import ROOT

EXAMPLES = sorted((ROOT / "deploy" / "configs").glob("*.yaml"))


def test_the_four_example_layouts_exist():
    layouts = {p.stem: load_config(str(p)) for p in EXAMPLES}
    ratios = {(c.prefill.replicas, c.decode.replicas) for c in layouts.values()}
    assert {(1, 1), (2, 1), (1, 2)} <= ratios
    assert any(c.registry.redis_url for c in layouts.values())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_config_checks_ok(path, tiny_llama, capsys):
    """Valid as written, and with a real checkpoint its KV cache is sized and fits."""
    assert main(["config", "check", str(path)]) == 0
    assert f"{path}: ok" in capsys.readouterr().out
    assert main(["config", "check", str(path), "--set", f"model={tiny_llama}"]) == 0
    out = capsys.readouterr().out
    assert out.count("kv cache  ") == 2 and "one request of 4096 tokens needs 256" in out


def test_check_summarises_the_layout(capsys):
    path = ROOT / "deploy" / "configs" / "2p1d-long-prompt.yaml"
    assert main(["config", "check", str(path), "--set", "decode.replicas=3"]) == 0
    out = capsys.readouterr().out
    assert "layout    2P3D" in out
    assert "prefill   2 x 127.0.0.1, ports 18100-18114" in out
    assert "decode    3 x 127.0.0.1, ports 18200-18224" in out


def test_an_ipv6_router_host_is_bracketed_in_its_url(capsys):
    path = ROOT / "deploy" / "configs" / "1p1d-demo.yaml"
    assert main(["config", "check", str(path), "--set", "router.host='::1'"]) == 0
    assert "router    http://[::1]:8000/v1" in capsys.readouterr().out


def test_ipv6_worker_hosts_are_taken(capsys):
    """An IPv6-only cluster's pod IPs (they were refused: the ZMQ sockets and the NCCL
    store took IPv4 alone). The wildcard is still no worker address."""
    path = ROOT / "deploy" / "configs" / "1p1d-demo.yaml"
    hosts = ["--set", "prefill.host='fd00::5'", "--set", "decode.host='::1'"]
    assert main(["config", "check", str(path), *hosts]) == 0
    out = capsys.readouterr().out
    assert "prefill   1 x fd00::5, ports 18100-18104" in out
    assert "decode    1 x ::1, ports 18200-18204" in out
    assert main(["config", "check", str(path), "--set", "decode.host='::'"]) != 0
    assert "decode.host" in capsys.readouterr().err


def test_show_prints_every_default_and_round_trips(tmp_path, capsys):
    path = ROOT / "deploy" / "configs" / "1p2d-long-output.yaml"
    assert main(["config", "show", str(path), "--set", "router.port=9000"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["router"]["port"] == 9000
    assert shown["engine"]["gpu_memory_utilization"] == 0.85  # a default, not in the file
    assert shown["decode"]["engine"]["max_num_seqs"] == 128
    assert build(PdserveConfig, shown) == load_config(str(path), ["router.port=9000"])
    assert to_dict(build(PdserveConfig, shown)) == shown
    # Without a file: the built-in config, as pdserve up runs it (an empty YAML was needed).
    assert main(["config", "show"]) == 0
    assert build(PdserveConfig, yaml.safe_load(capsys.readouterr().out)) == load_config(None)


def test_check_of_the_built_in_config_before_the_demo_model_is_made(tmp_path, monkeypatch):
    """It said the model's config.json "is not on this machine"; the demo is made later."""
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "config", "check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "the built-in config: ok" in result.stdout
    assert "kv cache  not sized: the demo model is made on first use (pdserve up)" in (
        result.stdout
    )


BROKEN = [
    ("engin: {}", "engin", "unknown key"),
    ("decode: {replica: 2}", "decode.replica", "unknown key"),
    ("prefill: {replicas: two}", "prefill.replicas", "must be an integer"),
    ("engine: {block_size: true}", "engine.block_size", "must be an integer"),
    ("router: {port: '8000'}", "router.port", "must be an integer"),
    ("prefill: {replicas: -1}", "prefill.replicas", "must be >= 0"),
    ("decode: {replicas: 0}", "decode.replicas", "at least one decode worker"),
    # (pdserve up passes keys as PDSERVE_API_KEYS, split on commas and spaces: "sk-a b"
    # became two keys, "b" among them)
    ("router: {api_keys: ['sk-a b']}", "router.api_keys", "without spaces or commas"),
    ("router: {api_keys: ['sk-a,b']}", "router.api_keys", "without spaces or commas"),
    ("router: {api_keys: ['clé']}", "router.api_keys", "printable ASCII"),
    # (it was replaced by offload.cpu_bytes without a word: no CPU tier)
    ("engine: {cpu_offload_bytes: 1000}", "engine.cpu_offload_bytes", "offload.cpu_bytes"),
    ("engine: {max_num_seqs: 0}", "engine.max_num_seqs", "must be > 0"),
    ("prefill: {replicas: 2, port: 18190}", "decode.port (replica 0)", "also used by prefill"),
    ("router: {port: 18100}", "prefill.port (replica 0)", "also used by router.port"),
    ("router: {host: 0.0.0.0, port: 18201}", "decode.port (replica 0)", "also used by router"),
    ("decode: {port: 65533}", "decode.port (replica 0)", "outside 1-65535"),
    ("decode: {engine: {max_num_seqs: many}}", "decode.engine.max_num_seqs", "an integer"),
    ("prefill: {engine: {batch: 8}}", "prefill.engine.batch", "unknown engine setting"),
    ("decode: {drain_grace_s: -1}", "decode.drain_grace_s", "must be >= 0"),
    ("decode: {drain_grace_s: .nan}", "decode.drain_grace_s", "must be a finite number"),
    ("kv_transfer: {lease_s: .inf}", "kv_transfer.lease_s", "must be a finite number"),
    ("prefill: {host: 0.0.0.0}", "prefill.host", "cannot be reached"),
    ("router: {served_model_name: 1:30}", "router.served_model_name", "quote it"),
    ("router: {max_inflight_requests: 8}", "router.max_inflight_requests", "renamed to"),
    ("router: {max_inflight_sequences: 0}", "router.max_inflight_sequences", "must be >= 1"),
    # A host that stands for no address: a bind or connect error much later, or none at all
    # (a router that retried a worker it would never reach).
    ("router: {host: localhst}", "router.host", "cannot resolve 'localhst': "),
    ("router: {host: 127.0.0.l}", "router.host", "cannot resolve '127.0.0.l': "),
    ("prefill: {host: localhst}", "prefill.host", "cannot resolve 'localhst': "),
    ("router: {host: '[::1]'}", "router.host", "without brackets ('::1')"),
    ("router: {host: '*'}", "router.host", "'0.0.0.0' is every IPv4 interface"),
    ("decode: {host: 'localhost:18200'}", "decode.host", "a host without its port"),
    # Another spelling of an address in use clashes too (only equal strings did).
    (
        "router: {host: '127.1', port: 18201}",
        "decode.port (replica 0)",
        "port 18201 on 127.0.0.1 is also used by router.port on 127.1",
    ),
    ("1: a\nfoo: b", "1", "unknown key"),
    ("decode: {engine: {block_size: 32}}", "decode.engine.block_size", "same block size"),
    (
        "decode: {engine: {tensor_parallel_size: 2}}",
        "decode.engine.tensor_parallel_size",
        "both roles need the same tensor_parallel_size",
    ),
    ("engine: {tensor_parallel_size: 0}", "engine.tensor_parallel_size", "must be > 0"),
    # The role the operator set it for is blamed (it was decode's in every case).
    (
        "prefill: {engine: {tensor_parallel_size: 2}}",
        "prefill.engine.tensor_parallel_size",
        "both roles need the same tensor_parallel_size",
    ),
    ("prefill: {engine: {block_size: 32}}", "prefill.engine.block_size", "same block size"),
    (
        "prefill: {engine: {kv_cache_dtype: fp8_e5m2}}\ndecode: {engine: {kv_cache_dtype: fp8}}",
        "decode.engine.kv_cache_dtype",
        "both roles need the same kv_cache_dtype",
    ),
    ("engine: {kv_cache_dtype: int8}", "engine.kv_cache_dtype", "not one of: auto, fp8"),
    # An fp8 cache: blocks rounded from float32 continued in bfloat16 (and, on shared
    # storage, kept apart by the dtype that computed them: never found).
    (
        "kv_transfer: {connector: shared_storage, shared_dir: /tmp/kv}\n"
        "engine: {kv_cache_dtype: fp8, device: cpu}\ndecode: {engine: {dtype: bfloat16}}",
        "decode.engine.dtype",
        "rounded to the fp8 cache from prefill's dtype",
    ),
    (
        "decode: {engine: {scheduling_policy: priority}}",
        "decode.engine.scheduling_policy",
        "both roles need the same scheduling_policy",
    ),
    ("engine: {scheduling_policy: lifo}", "engine.scheduling_policy", "not one of: fcfs"),
    (
        "decode: {engine: {linear_state_dtype: bfloat16}}",
        "decode.engine.linear_state_dtype",
        "both roles need the same linear_state_dtype",
    ),
    ("engine: {linear_state_dtype: fp8}", "engine.linear_state_dtype", "not one of: float32"),
    ("kv_transfer: {connector: rdma}", "kv_transfer.connector", "not one of: nixl"),
    ("kv_transfer: {connector: shared_storage}", "kv_transfer.shared_dir", "needs a dir"),
    ("kv_transfer: {lease_s: 5, timeout_s: 5}", "kv_transfer.timeout_s", "below lease_s"),
    ("kv_transfer: {lease_s: 5, timeout_s: 4.5}", "kv_transfer.timeout_s", "a call's transit"),
    ("kv_transfer: {shared_max_bytes: -1}", "kv_transfer.shared_max_bytes", "must be >= 0"),
    ("kv_transfer: {failure_policy: retry}", "kv_transfer.failure_policy", "not one of"),
    ("kv_transfer: {nixl_read_lanes: -2}", "kv_transfer.nixl_read_lanes", "must be >= 0"),
    ("kv_transfer: {nixl_pin_lanes: 2}", "kv_transfer.nixl_pin_lanes", "must be true or false"),
    ("registry: {redis_url: 'localhost:6379'}", "registry.redis_url", "not a Redis URL"),
    # redis-py took these for localhost:6379 (or database 0), without a word.
    ("registry: {redis_url: 'redis://'}", "registry.redis_url", "names no host"),
    ("registry: {redis_url: 'redis://r:0/0'}", "registry.redis_url", "port 0"),
    ("registry: {redis_url: 'redis://r/one'}", "registry.redis_url", "database 'one'"),
    ("registry: {redis_url: 'redis://r:63790x/0'}", "registry.redis_url", "port that is no"),
    ("registry: {redis_url: 'redis://::1:6379/0'}", "registry.redis_url", "without brackets"),
    ("registry: {redis_url: 'unix://redis.sock'}", "registry.redis_url", "names no socket path"),
    ("registry: {ttl_s: 2, heartbeat_s: 2}", "registry.heartbeat_s", "at most half of"),
    ("registry: {ttl_s: 4, heartbeat_s: 2.5}", "registry.heartbeat_s", "at most half of"),
    # Compared with a URL's host: these never matched, and every fetch was refused.
    (
        "router: {allowed_media_domains: ['https://images.example.com']}",
        "router.allowed_media_domains",
        "is not a host name",
    ),
    (
        "router: {allowed_media_domains: ['images.example.com:8443']}",
        "router.allowed_media_domains",
        "is not a host name",
    ),
    ("router: {allowed_media_domains: ['*']}", "router.allowed_media_domains", "host name"),
    # YAML 1.1 reads 1.2e3 as text: the message says so.
    ("router: {request_timeout_s: 1.2e3}", "router.request_timeout_s", "write 1.2e+3"),
    # Redis keeps whole milliseconds: 0.0009 s deleted every entry as it was registered.
    ("registry: {ttl_s: 0.0009, heartbeat_s: 0.0001}", "registry.ttl_s", "at least 1"),
    ("engine: {gpu_memory_utilization: 1.5}", "engine.gpu_memory_utilization", "(0, 1]"),
    ("- prefill\n- decode", "config", "must hold a mapping"),
    ("prefill: [1, 2", "config", "not valid YAML"),
    # A typo is answered with the key it is closest to (the list of all only without one).
    ("engine: {blok_size: 32}", "engine.blok_size", "unknown key; did you mean block_size?"),
    (
        "decode: {engine: {max_num_seq: 8}}",
        "decode.engine.max_num_seq",
        "unknown engine setting; did you mean max_num_seqs",
    ),
    # PyYAML keeps a repeated key's last value, silently: the first engine section was lost.
    (
        "engine: {max_num_seqs: 8}\nengine: {block_size: 32}",
        "config",
        "line 2: 'engine' is given twice in one mapping",
    ),
    ("engine:\n  block_size: 16\n  block_size: 32", "config", "line 3: 'block_size' is given"),
]


@pytest.mark.parametrize(("text", "key", "message"), BROKEN, ids=[b[1] for b in BROKEN])
def test_broken_config_names_the_key(text, key, message, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as error:
        load_config(str(path))
    assert error.value.key == key
    assert message in str(error.value)


def test_files_that_are_not_utf_8_and_overrides_that_are_not_yaml_are_named(tmp_path):
    """Both were tracebacks (UnicodeDecodeError, yaml's ParserError)."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text") as error:
        load_config(str(path))
    assert error.value.key == "config"
    with pytest.raises(ConfigError, match="is not valid YAML") as error:
        load_config(None, ["engine.block_size=[1"])
    assert error.value.key == "engine.block_size"


KV_BROKEN = [
    (["engine.device=cpu", "engine.num_blocks=10"], "engine.num_blocks",
     "10 KV blocks cannot hold one request of max_model_len=4096"),
    (["decode.engine.num_blocks=3"], "decode.engine.num_blocks", "3 KV blocks cannot hold"),
    (["engine.device=cpu", "engine.kv_cache_bytes=1000000"], "engine.kv_cache_bytes",
     "15 KV blocks, which cannot hold one request"),
    (["engine.device=cpu", "engine.num_blocks=100000"], "engine.num_blocks",
     "need 6250.0 MiB, more than engine.kv_cache_bytes=1073741824"),
    (["engine.device=cpu", "prefill.engine.kv_cache_bytes=4194304"],
     "prefill.engine.kv_cache_bytes", "64 KV blocks"),
    (["engine.tensor_parallel_size=3"], "engine.tensor_parallel_size",
     "4 attention heads do not split over 3 ranks"),
    (["engine.tensor_parallel_size=8"], "engine.tensor_parallel_size",
     "4 attention heads do not split over 8 ranks"),
    # Per rank: 2 of 4 ranks share each KV head, so a block costs 32 KiB per rank.
    (["engine.device=cpu", "engine.tensor_parallel_size=4", "engine.kv_cache_bytes=4194304"],
     "engine.kv_cache_bytes", "128 KV blocks, which cannot hold"),
    # A block table past reason: the worker's start failed on a 100 GB allocation.
    (["engine.max_num_seqs=100000000"], "engine.max_num_seqs", "block table"),
    # KV elements the roles' dtype or device make differ: every pull failed at handshake.
    (["prefill.engine.device=cpu", "decode.engine.device=cuda"], "decode.engine.device",
     "prefill computes in float32 and decode in a 16-bit dtype"),
    (["engine.device=cpu", "prefill.engine.dtype=bfloat16"], "prefill.engine.dtype",
     "prefill computes in bfloat16 and decode in float32"),
    # One role's dtype on an auto device: float32 on a CPU, 16-bit on a GPU, never both.
    (["decode.engine.dtype=bfloat16"], "decode.engine.dtype",
     "prefill's dtype is auto on an auto device"),
    (["prefill.engine.dtype=float32"], "prefill.engine.dtype",
     "decode's dtype is auto on an auto device"),
    # One role on a CPU (float32), the other on an auto device (16-bit on a GPU host).
    (["prefill.engine.device=cpu"], "prefill.engine.device",
     "decode's dtype is auto on an auto device"),
    # A CPU tier of less than a block: the worker refuses to start, so the check does too.
    (["engine.device=cpu", "offload.cpu_bytes=100"], "offload.cpu_bytes",
     "100 bytes hold no block of 65536 bytes"),
    # Past the model's context (4096): it was cut to 4096 with a warning in the worker's log.
    (["decode.engine.max_model_len=100000"], "decode.engine.max_model_len",
     "100000 is beyond the model's context of 4096 tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "key", "message"), KV_BROKEN, ids=[k[1] for k in KV_BROKEN])
def test_kv_blocks_that_do_not_fit_are_named(overrides, key, message, tiny_llama):
    """Sized from the checkpoint's config.json (4 layers, 2 KV heads of 64, float32 on CPU:
    64 KiB per 16-token block; 4096 positions need 256 blocks)."""
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"model={tiny_llama}", *overrides])
    assert error.value.key == key
    assert message in str(error.value)


def test_a_fitting_pool_passes_and_auto_devices_only_warn(tiny_llama, capsys):
    fits = [f"model={tiny_llama}", "engine.device=cpu", "engine.max_model_len=1024",
            "engine.kv_cache_bytes=4194304"]  # fmt: skip
    load_config(None, fits)  # 64 blocks hold 1024 tokens exactly
    # device auto may be CUDA where it runs: the CPU arithmetic is a warning, exit 0.
    auto = ["--set", f"model={tiny_llama}", "--set", "engine.kv_cache_bytes=1000000"]
    assert main(["config", "check", str(EXAMPLES[0]), *auto]) == 0
    assert "warning: prefill: engine.kv_cache_bytes: on a host without CUDA" in (
        capsys.readouterr().err
    )


def test_check_and_workers_refuse_before_starting(tmp_path):
    """Exit 2 with the named error from the console script, and a worker given the same
    config refuses before it loads anything."""
    path = tmp_path / "broken.yaml"
    path.write_text("decode: {replicas: 2, port: 18100}\n")
    for args in (["config", "check", str(path)], ["decode", "--config", str(path)]):
        result = subprocess.run(
            [sys.executable, "-m", "deploy.cli", *args],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "error: decode.port (replica 0): port 18100 on 127.0.0.1 is also used by " \
               "prefill.port (replica 0)" in result.stderr  # fmt: skip
        assert result.stdout == ""


def test_examples_are_documented():
    """Each example says what its ratio is for and when to change it."""
    for path in EXAMPLES:
        comments = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        assert "What the ratio is for" in comments, path.name
        assert "When to change it" in comments or "when to change it" in comments, path.name


@pytest.mark.parametrize(("kv_cache_dtype", "num_blocks"), [("auto", 38), ("fp8", 152)])
def test_torch_free_sizing_agrees_with_the_engine(tiny_llama, kv_cache_dtype, num_blocks):
    """The up-front arithmetic is the engine's: same bytes per block, same pool size
    (an FP8 cache holds four times float32's blocks)."""
    from common.config import Role
    from common.kv_budget import kv_budgets
    from engine.llm_engine import LLMEngine

    overrides = [f"model={tiny_llama}", "engine.device=cpu", "engine.max_model_len=512",
                 "engine.kv_cache_bytes=5000000", "engine.block_size=32",
                 f"engine.kv_cache_dtype={kv_cache_dtype}"]  # fmt: skip
    config = load_config(None, overrides)
    budget = next(b for b in kv_budgets(config) if b.role is Role.DECODE)
    runner = LLMEngine(tiny_llama, config.engine_for(Role.DECODE)).runner
    assert (budget.bytes_per_block, budget.num_blocks) == (
        runner.bytes_per_block,
        runner.num_blocks,
    )
    assert budget.min_blocks == 16 and budget.num_blocks == num_blocks


def test_torch_free_sizing_is_per_tensor_parallel_rank(tiny_llama, model_factory):
    """Each rank holds its KV heads (one of the two here), and the dense and expert widths
    a split would cut are read as the engine reads them."""
    from common.config import Role
    from common.kv_budget import ModelShape, kv_budgets
    from engine.models.arch import read_arch_config
    from engine.parallel.shard_spec import split_widths

    overrides = [f"model={tiny_llama}", "engine.device=cpu", "engine.max_model_len=512",
                 "engine.kv_cache_bytes=5000000", "engine.tensor_parallel_size=2"]  # fmt: skip
    budget = next(b for b in kv_budgets(load_config(None, overrides)) if b.role is Role.DECODE)
    assert budget.bytes_per_block == 32 * 1024 and budget.num_blocks == 152
    for arch in ("llama", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3"):
        model_dir = model_factory(arch)
        shape = ModelShape.read(model_dir)
        assert dict(shape.split_widths) == split_widths(read_arch_config(model_dir)), arch


def test_enum_settings_built_in_python_are_enums():
    """Built in code (not from a file), a string policy must still mean the policy:
    ``is FailurePolicy.RECOMPUTE`` on a plain str was False, which turned recompute off."""
    from common.config import FailurePolicy, KVTransferSettings

    assert KVTransferSettings(failure_policy="fail").failure_policy is FailurePolicy.FAIL


def test_check_lists_the_lora_adapters(tiny_llama, tmp_path, capsys):
    from engine.models.lora_maker import make_lora_adapter

    adapter = make_lora_adapter(tiny_llama, tmp_path / "alice", rank=4, targets=("q_proj",))
    (tmp_path / "empty").mkdir()
    path = ROOT / "deploy" / "configs" / "1p1d-demo.yaml"
    adapters = f"lora.adapters={{alice: {adapter}, gone: /nowhere, empty: {tmp_path / 'empty'}}}"
    assert main(["config", "check", str(path), "--set", adapters]) == 0
    out = capsys.readouterr().out
    assert f"lora      alice: {adapter} (rank 4, alpha 16.0; q_proj)" in out
    assert "lora      gone: /nowhere (not on this machine: not checked)" in out
    assert "empty" in out and "warning: no adapter_config.json" in out


def test_check_refuses_score_tokens_that_are_not_one_token(tiny_llama, capsys):
    """As the router would at start: a reranker's token must be one token of the model's
    vocabulary (the tiny one splits "yes"). Unquoted, YAML reads no and yes as booleans:
    the error says to quote them."""
    score = ["--set", f"model={tiny_llama}", "--set", "router.score_method=token_logits"]
    assert main(["config", "check", str(EXAMPLES[0]), *score,
                 "--set", "router.score_tokens=[no, yes]"]) == 2  # fmt: skip
    assert "router.score_tokens[0]: must be a string, got False (quote it" in (
        capsys.readouterr().err
    )
    assert main(["config", "check", str(EXAMPLES[0]), *score,
                 "--set", 'router.score_tokens=["no", "yes"]']) == 2  # fmt: skip
    assert "router.score_tokens: 'yes' is 2 tokens" in capsys.readouterr().err
    assert main(["config", "check", str(EXAMPLES[0]), *score,
                 "--set", 'router.score_tokens=["no", "ok"]']) == 0  # fmt: skip
    # No model on this machine yet (the demo is made at the first start): not checked,
    # and said so.
    capsys.readouterr()
    assert main(["config", "check", str(EXAMPLES[0]), "--set", "model=/nowhere",
                 "--set", "router.score_method=token_logits",
                 "--set", 'router.score_tokens=["no", "yes"]']) == 0  # fmt: skip
    assert "router.score_tokens not checked" in capsys.readouterr().err


def test_anchors_and_merge_keys_still_share_settings(tmp_path):
    """The loader that refuses repeated keys keeps YAML's merge key (its first version
    refused every config using one) and refuses unhashable keys in one line."""
    path = tmp_path / "merged.yaml"
    path.write_text("prefill:\n  engine: &shared {max_num_seqs: 8, block_size: 32}\n"
                    "decode:\n  engine: {<<: *shared, max_num_seqs: 16}\n"
                    "engine: {block_size: 32}\n")  # fmt: skip
    config = load_config(str(path))
    assert config.engine_for(Role.PREFILL).max_num_seqs == 8
    assert config.engine_for(Role.DECODE).max_num_seqs == 16
    assert config.engine_for(Role.DECODE).block_size == 32
    path.write_text("? [a, b]\n: 1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(path))


def test_a_checkpoint_config_that_is_not_a_mapping_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[]")  # (an AttributeError's traceback)
    with pytest.raises(ConfigError, match="is not a usable checkpoint config") as error:
        load_config(None, [f"model={tmp_path}"])
    assert error.value.key == "model"


def test_an_adapter_name_with_dots_is_one_name_in_an_override():
    """``--set lora.adapters.my.v1=...`` made an adapter "my" holding a key "v1"."""
    from common.config_loader import apply_overrides

    data = apply_overrides({}, ["lora.adapters.my.v1=/adapters/a", "engine.block_size=32"])
    assert data == {"lora": {"adapters": {"my.v1": "/adapters/a"}}, "engine": {"block_size": 32}}


def test_a_tilde_in_a_path_is_the_users_home(tmp_path, monkeypatch):
    """Taken literally, a model under ~/... was "no checkpoint directory" and
    ``kv_transfer.shared_dir: ~/kv`` made a directory named "~" in the working directory
    (an audit)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "model": "~/models/m", "kv_transfer": {"connector": "shared_storage", "shared_dir": "~/kv"},
        "lora": {"adapters": {"a": "~/adapters/a"}}, "planner": {"profile": "~/plan.json"},
        "decode": {"engine": {"speculative_method": "draft_model", "draft_model": "~/draft"}},
    }))  # fmt: skip
    overrides = ["engine.speculative_method=draft_model", "engine.draft_model=~/draft"]
    config = load_config(str(path), overrides)
    home = str(tmp_path)
    assert config.model == f"{home}/models/m"
    assert config.kv_transfer.shared_dir == f"{home}/kv"
    assert config.lora.adapters == {"a": f"{home}/adapters/a"}
    assert config.planner.profile == f"{home}/plan.json"
    assert config.engine.draft_model == f"{home}/draft"
    assert config.engine_for(Role.DECODE).draft_model == f"{home}/draft"
    assert load_config(None, ["model=models/~x"]).model == "models/~x"  # (leading only)
