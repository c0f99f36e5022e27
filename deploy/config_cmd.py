"""``pdserve config check|show FILE``: validate a deployment config before anything starts,
or print it resolved (defaults filled in, ``--set`` applied).

``check`` exits 0 with a summary of the layout, or 2 with the error naming the key; it
loads the config exactly as every other entry point does (``load_config``), so a config
that passes here is one ``pdserve up``, the workers and the router accept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.hosts import host_port
from common.kv_budget import KVBudget, kv_budgets
from common.model_info import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_text_parsers,
    checkpoint_text_config,
    model_dir_of,
)
from common.redis_password import without_password
from common.router_config import ScoreMethod
from common.tracing import check_installed
from deploy.config_args import add_overrides
from deploy.ephemeral_ports import ephemeral_port_warnings, ephemeral_range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, help_text in (
        ("check", "validate the config; print a summary (exit 0) or the error (exit 2)"),
        ("show", "print the resolved config (defaults filled in, overrides applied)"),
    ):
        sub = actions.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "file", nargs="?", default=None,
            help="deployment YAML (default: the built-in config, as for pdserve up)",
        )  # fmt: skip
        add_overrides(sub)


def run(args: argparse.Namespace) -> int:
    from common.config_loader import load_config, to_dict

    try:
        config = load_config(args.file, args.overrides)
        budgets = kv_budgets(config)
        hf_config = checkpoint_text_config(config)
        if hf_config is not None:
            check_text_parsers(config, hf_config)
            check_score_tokens(config)
        elif config.router.score_method is ScoreMethod.TOKEN_LOGITS:
            print("warning: router.score_tokens not checked: the model is not on this "
                  "machine yet (the router checks them at start)", file=sys.stderr)  # fmt: skip
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # the processes check where they run (the image has it); here only a warning
        check_installed(config.tracing)
    except ConfigError as exc:
        print(f"warning: {exc}", file=sys.stderr)
    if args.action == "show":
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    print(f"{args.file or 'the built-in config'}: ok")
    for line in summary(config, budgets):
        print(f"  {line}")
    for budget in budgets or []:
        for warning in budget.warnings:
            print(f"warning: {budget.role}: {warning}", file=sys.stderr)
    for warning in ephemeral_port_warnings(config, ephemeral_range()):
        print(f"warning: {warning}", file=sys.stderr)
    if config.planner.profile is not None:
        from planner.profile_data import ProfileError, read_profile

        try:
            read_profile(Path(config.planner.profile))
        except ProfileError as exc:  # where the router runs, it may be another path
            print(f"warning: planner.profile: {exc} (the router refuses to start without "
                  "it)", file=sys.stderr)  # fmt: skip
    return 0


def check_score_tokens(config: PdserveConfig) -> None:
    """``router.score_tokens`` are each one token of the model's vocabulary, as the router
    will check at start."""
    if config.router.score_method is ScoreMethod.TOKEN_LOGITS:
        from common.tokenizer import Tokenizer, TokenizerError
        from router.scoring import Scorer

        model_dir = model_dir_of(config)
        try:
            tokenizer = Tokenizer(model_dir)
        except TokenizerError as exc:
            message = f"no tokenizer to check router.score_tokens by: {exc}"
            raise ConfigError("model", message) from None
        Scorer.build(config.router, tokenizer, model_dir)


def summary(config: PdserveConfig, budgets: list[KVBudget] | None) -> list[str]:
    """Human-readable lines: the xPyD layout, where everything listens, and the KV pools."""
    prefill, decode, planner = config.prefill, config.decode, config.planner
    lines = [f"layout    {prefill.replicas}P{decode.replicas}D"]
    if planner.autoscale:
        lines[0] += (f", autoscaled from {planner.min_prefill_replicas}P"
                     f"{planner.min_decode_replicas}D to follow the router's plan")  # fmt: skip
    for role in Role:
        section = config.role(role)
        if section.replicas:
            last = section.ports(section.replicas - 1).kv_store
            lines.append(
                f"{role.value:<9} {section.replicas} x {section.host}, ports "
                f"{section.port}-{last} (drain grace {section.drain_grace_s:g}s)"
            )
    router = config.router
    lines.append(f"router    http://{host_port(router.host, router.port)}/v1")
    url = config.registry.redis_url
    registry = without_password(url, mask="***") if url else "static list from this file"
    lines.append(f"registry  {registry}")
    transfer = config.kv_transfer
    lines.append(
        f"transfer  {transfer.connector}, lease {transfer.lease_s:g}s, pull timeout "
        f"{transfer.timeout_s:g}s, on failure {transfer.failure_policy.value}"
    )
    if planner.profile is not None:
        from planner.sizing import statistic

        lines.append(
            f"planner   {planner.profile}: {statistic(planner.ttft_percentile)} TTFT "
            f"{planner.ttft_ms:g} ms, {statistic(planner.itl_percentile)} ITL "
            f"{planner.itl_ms:g} ms, over the last {planner.window_s:g}s, every "
            f"{planner.interval_s:g}s"
        )
    model = config.model or f"demo ({model_dir_of(config)})"
    lines.append(f"model     {model}")
    for name, path in sorted(config.lora.adapters.items()):
        lines.append(f"lora      {name}: {_adapter(Path(path))}")
    if budgets is None and config.model is None:
        lines.append("kv cache  not sized: the demo model is made on first use (pdserve up)")
    elif budgets is None:
        lines.append("kv cache  not sized: the model's config.json is not on this machine")
    for budget in budgets or []:
        lines.append(f"kv cache  {budget.role.value}: {_pool(config, budget)}")
    for budget in budgets or []:
        if budget.state_slots:  # a hybrid model's linear-attention states, reserved up front
            engine = config.engine_for(budget.role)
            total = budget.state_slots * budget.state_bytes_per_slot
            lines.append(
                f"states    {budget.role.value}: {budget.state_slots} slots of "
                f"{budget.state_bytes_per_slot / 2**20:.2f} MiB "
                f"({engine.linear_state_dtype.value}) = {total / 2**20:.1f} MiB per rank, "
                "taken from the KV cache's memory"
            )
    return lines


def _pool(config: PdserveConfig, budget: KVBudget) -> str:
    engine = config.engine_for(budget.role)
    per_block = budget.bytes_per_block or budget.cpu_bytes_per_block
    blocks = f"{budget.block_size}-token blocks of {_kib(per_block)}"
    if budget.num_blocks is not None:
        size = f"{budget.num_blocks} {blocks}"
    elif engine.device.value == "cuda":
        size = f"{blocks}, {engine.gpu_memory_utilization:g} of GPU memory"
    else:
        cpu_blocks = engine.kv_cache_bytes // budget.cpu_bytes_per_block
        size = f"{cpu_blocks} {blocks} on CPU (CUDA: {engine.gpu_memory_utilization:g} of GPU)"
    tp_size = engine.tensor_parallel_size
    per_rank = f" on each of {tp_size} tensor-parallel ranks" if tp_size > 1 else ""
    return (
        f"{size}{per_rank}; one request of {budget.max_model_len} tokens needs {budget.min_blocks}"
    )


def _adapter(path: Path) -> str:
    """What an adapter directory holds, as far as its config says (workers load it)."""
    config_path = path / ADAPTER_CONFIG
    if not path.exists():
        return f"{path} (not on this machine: not checked)"
    if not config_path.is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        return f"{path} (warning: no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
    adapter = json.loads(config_path.read_text())
    targets = adapter.get("target_modules")
    targets = ", ".join(targets) if isinstance(targets, list) else targets
    return f"{path} (rank {adapter.get('r')}, alpha {adapter.get('lora_alpha')}; {targets})"


def _kib(num_bytes: int) -> str:
    return f"{num_bytes / 1024:g} KiB"


COMMAND = ("validate a deployment config or print it resolved", add_arguments, run)
