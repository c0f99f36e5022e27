"""The console script, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_commands_that_do_not_run_the_engine_do_not_import_torch():
    """Every ``pdserve`` process builds the whole parser; torch's import (~2.5 s of CPU)
    belongs to the workers and the engine's commands only, not to the launcher, the router,
    the probes or the config tools (Kubernetes runs ``pdserve health`` as a probe)."""
    code = (
        "import sys\n"
        "from deploy.cli import build_parser\n"
        "parser = build_parser()\n"
        "for argv in (['up'], ['router'], ['health', '--http', 'x'], ['config', 'check', 'x'],\n"
        "             ['make-model', '--out', 'x'], ['make-lora', '--out', 'x']):\n"
        "    parser.parse_args(argv)\n"
        "import deploy.up, deploy.config_cmd, deploy.render_k8s, deploy.render_compose\n"
        "import router.main\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_make_model_then_generate(tmp_path, capsys):
    """The script itself makes the model; the rest runs ``main`` in this process (one
    interpreter start less per command)."""
    from deploy.cli import main

    out = tmp_path / "qwen3"
    made = run_cli("make-model", "--arch", "qwen3", "--size", "tiny", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert main(["make-model", "--arch", "qwen3", "--out", str(out)]) == 2
    assert "already holds" in capsys.readouterr().err
    assert main(["generate", "--model", str(out), "--prompt", "hello", "--max-tokens", "5"]) == 0
    assert "output (5 tokens, length)" in capsys.readouterr().out


def test_make_lora_then_generate_with_it(tiny_llama, tmp_path, capsys):
    from deploy.cli import main

    out = tmp_path / "alice"
    made = run_cli("make-lora", "--model", str(tiny_llama), "--out", str(out), "--rank", "4",
                   "--targets", "q_proj", "v_proj")  # fmt: skip
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == ["q_proj", "v_proj"]
    assert main(["make-lora", "--model", str(tiny_llama), "--out", str(out)]) == 2
    generate = ["generate", "--model", str(tiny_llama), "--prompt", "hello", "--max-tokens", "8"]
    capsys.readouterr()
    assert main(generate) == 0
    base = capsys.readouterr().out
    assert main([*generate, "--lora", str(out)]) == 0
    adapted = capsys.readouterr().out
    assert "output (8 tokens, length)" in adapted and adapted != base
    assert main([*generate, "--lora", str(tmp_path / "nowhere")]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def test_generate_uses_the_demo_model(tmp_path):
    result = run_cli("generate", "--max-tokens", "4", env={"PDSERVE_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- prompt:") == 4
    assert (tmp_path / "models" / "demo-llama-tiny" / "config.json").exists()


def test_generate_over_two_ranks_prints_the_same_text(tiny_llama, capsys):
    from deploy.cli import main

    outputs = []
    for tp_size in ("1", "2"):
        argv = ["generate", "--model", str(tiny_llama), "--max-tokens", "6", "-tp", tp_size]
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].count("--- prompt:") == 4
    assert main(["generate", "--model", str(tiny_llama), "-tp", "3"]) == 2
    assert "4 attention heads do not split over 3 ranks" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(tiny_llama):
    result = run_cli("generate", "--model", str(tiny_llama), "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature must be in [0, 100]" in result.stderr


def test_make_model_writes_an_fp8_checkpoint_that_generates(tmp_path, capsys):
    from deploy.cli import main
    from engine.models.arch import read_arch_config

    out = tmp_path / "fp8"
    assert main(["make-model", "--out", str(out), "--fp8", "ct-block"]) == 0
    assert "FP8 (ct-block) weights" in capsys.readouterr().out
    assert read_arch_config(out).fp8_weights.block_size == (128, 128)
    assert main(["generate", "--model", str(out), "--prompt", "hello", "--max-tokens", "5"]) == 0
    assert "output (5 tokens, length)" in capsys.readouterr().out


def test_make_model_writes_a_gptq_checkpoint_that_generates(tmp_path, capsys):
    from deploy.cli import main
    from engine.models.arch import read_arch_config

    out = tmp_path / "gptq"
    assert main(["make-model", "--out", str(out), "--int", "gptq-act-order"]) == 0
    assert "packed integer (gptq-act-order) weights" in capsys.readouterr().out
    assert read_arch_config(out).int_weights.method == "gptq"
    assert main(["generate", "--model", str(out), "--prompt", "hello", "--max-tokens", "5"]) == 0
    assert "output (5 tokens, length)" in capsys.readouterr().out
    args = ["make-model", "--out", str(tmp_path / "both"), "--fp8", "fbgemm", "--int", "awq"]
    with pytest.raises(SystemExit):  # one quantization at a time
        main(args)


@pytest.mark.skipif(torch_sees_cuda(), reason="this machine has a CUDA device")
def test_a_device_this_machine_lacks_is_refused_before_serving(tmp_path):
    """engine.device cuda without CUDA failed inside torch (an assertion's traceback);
    the triton backend on a CPU without the interpreter started and then failed each
    request's first step (a worker restarted over and over behind a 503). Both are said
    before the demo model is made (seconds: nothing is written)."""
    env = {"PDSERVE_HOME": str(tmp_path), "TRITON_INTERPRET": "0"}
    cases = [(["--device", "cuda"], "engine.device"),
             (["--attention-backend", "triton"], "engine.attention_backend")]  # fmt: skip
    for flags, key in cases:
        out = run_cli("generate", "--prompt", "hi", "--max-tokens", "2", *flags, env=env)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith(f"error: {key}: ")
        assert "Traceback" not in out.stderr
        assert not any(tmp_path.iterdir())


def test_paths_and_values_the_user_got_wrong_are_one_line(tmp_path, capsys):
    """Each was a traceback (run in this process: ``main``'s own handling is the test)."""
    from deploy.cli import main

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    config = "deploy/configs/1p1d-demo.yaml"
    not_a_profile = tmp_path / "profile.json"
    not_a_profile.write_text('{"not": "a profile"}')
    profile = ["--set", f"planner.profile={not_a_profile}"]
    cases = [
        *((["deploy", target, "--config", config, *profile, *out], 2, "not a pdserve profile")
          for target, out in [("compose", []), ("k8s", []),
                              ("k8s", ["--out", str(tmp_path / "k8s")])]),
        (["--log-level", "LOUD", "health", "--http", "x"], 2, "invalid choice: 'LOUD'"),
        (["health", "--http", "notaurl"], 1, "notaurl: unknown url type"),
        (["make-model", "--out", str(a_file / "m")], 2, "error: "),
        (["make-lora", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "a")], 2,
         "does not exist"),
        (["deploy", "compose", "--config", config, "--variant", "cuda", "--gpus", "-1"], 2,
         "must be >= 0"),
        (["deploy", "k8s", "--config", config, "--out", str(a_file)], 2, "Not a directory"),
    ]  # fmt: skip
    for argv, code, message in cases:
        try:
            got = main(argv)
        except SystemExit as exit_:  # argparse's own refusals
            got = exit_.code
        out = capsys.readouterr()
        assert got == code, (argv, out.err)
        assert message in out.err + out.out and "Traceback" not in out.err, (argv, out.err)
