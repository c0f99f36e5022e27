"""The README opens with the two set-up commands, and CI runs the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert "pdserve" in commands[0] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert readme_commands()[1] == ci[-1]


def test_the_qwen3_reranker_example_is_its_reference_prompt():
    """The README's ``score_template`` for Qwen3-Reranker, read as the config loader
    reads YAML, is the model card's prompt (prefix + instruction, query, document +
    suffix), trailing blank lines included."""
    import textwrap

    import yaml

    from common.config_loader import build
    from common.router_config import RouterConfig

    text = (ROOT / "README.md").read_text()
    block = text.split("For Qwen3-Reranker:", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    router = build(RouterConfig, yaml.safe_load(textwrap.dedent(block))["router"])
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
              'the Query and the Instruct provided. Note that the answer can only be "yes" or '
              '"no".<|im_end|>\n<|im_start|>user\n')  # fmt: skip
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    body = ("<Instruct>: Given a web search query, retrieve relevant passages that answer the "
            "query\n<Query>: {query}\n<Document>: {document}")  # fmt: skip
    assert router.score_template == prefix + body + suffix
    assert router.score_tokens == ("no", "yes")
