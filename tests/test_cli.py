"""atom-engine, run as a user runs it: in a subprocess, checking exit codes and what reaches the terminal."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from atom import cli

ENGINE_FLAGS = [
    "--model", "--tokenizer", "--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
    "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
    "--no-enable-chunked-prefill", "--num-gpu-blocks-override", "--kv-cache-memory", "--seed", "--device",
    "--speculative-config", "--async-scheduling", "--no-async-scheduling", "--enforce-eager", "--num-scheduler-steps",
    "--load-format",
]
SERVE_FLAGS = ["--host", "--port", "--api-key", "--served-model-name", "--no-uvloop"]
GENERATE_FLAGS = ["--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--ignore-eos"]


def _command() -> list[str]:
    script = shutil.which("atom-engine")
    return [script] if script else [sys.executable, "-m", "atom"]


def _env(tmp_path) -> dict[str, str]:
    # One thread: tiny matmuls gain nothing from more, and spinning threads crawl on a busy machine.
    return {**os.environ, "ATOM_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run_cli(args: list[str], tmp_path, timeout: float = 120, command: list[str] | None = None):
    return subprocess.run((command or _command()) + args, capture_output=True, text=True, timeout=timeout,
                          env=_env(tmp_path))


def _one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("atom-engine: error: ")
    return lines[0]


def test_help_lists_every_flag(tmp_path, capsys):
    top = run_cli(["--help"], tmp_path, command=[sys.executable, "-m", "atom"])  # python -m atom works too
    assert top.returncode == 0 and "serve" in top.stdout and "generate" in top.stdout
    for command, flags in (("serve", SERVE_FLAGS), ("generate", GENERATE_FLAGS)):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        missing = [f for f in ENGINE_FLAGS + flags if f not in out]
        assert not missing, f"{command} --help does not mention {missing}"


def test_generate_streams_text(tmp_path, kimi_ckpt):
    result = run_cli(["generate", "--model", kimi_ckpt, "--prompt", "Hello", "--max-tokens", "8",
                      "--temperature", "0", "--ignore-eos"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "8 tokens in" in result.stderr and "tok/s" in result.stderr


def test_bad_flag_is_one_line_naming_it(tmp_path):
    line = _one_line_error(run_cli(["generate", "--prompt", "x", "--no-such-flag"], tmp_path))
    assert "--no-such-flag" in line


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--speculative-config", "{bad"], "--speculative-config"),
        (["--speculative-config", '{"method": "ngram", "k": 2}'], "unknown key"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--temperature", "-1"], "temperature"),
        (["--num-scheduler-steps", "0"], "num_scheduler_steps"),
        (["--num-scheduler-steps", "4", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
         "does not combine with speculative decoding"),
        (["--device", "gpu"], "device 'gpu' is not supported; use --device cpu, cuda or cuda:N"),
        (["--device", "cuda:x"], "device 'cuda:x' is not supported"),
        (["--device", "cuda:99"] if torch.cuda.is_available() else ["--device", "cuda"],
         "only" if torch.cuda.is_available() else "sees no CUDA GPU; use --device cpu"),
    ],
)
def test_bad_values_are_one_line_without_traceback(kimi_ckpt, capsys, args, expect):
    # In-process (a subprocess per case is slow): argparse exits, EngineConfig's ValueError is returned as 2.
    try:
        code = cli.main(["generate", "--model", kimi_ckpt, "--prompt", "x", *args])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    line = _one_line_error(subprocess.CompletedProcess([], code, captured.out, captured.err))
    assert expect in line


def test_unknown_model_folder(tmp_path):
    line = _one_line_error(run_cli(["generate", "--prompt", "x", "--model", "/nonexistent"], tmp_path))
    assert "/nonexistent" in line and "does not exist" in line


def test_flags_map_onto_engine_config(kimi_ckpt):
    args = cli.build_parser().parse_args([
        "serve", "--model", kimi_ckpt, "--max-num-seqs", "3", "--num-gpu-blocks-override", "300",
        "--kv-cache-memory", "64M", "--no-enable-prefix-caching", "--async-scheduling", "--enforce-eager",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
    ])
    config = cli.engine_config_from_args(args)
    assert (config.max_num_seqs, config.num_gpu_blocks, config.kv_cache_memory) == (3, 300, 64 << 20)
    assert not config.enable_prefix_caching and config.async_scheduling and config.enforce_eager
    assert config.speculative_config.method == "ngram" and config.num_speculative_tokens == 2
    assert config.max_num_batched_tokens == 2048  # untouched flags keep EngineConfig's defaults
    assert config.num_scheduler_steps == 1
    args = cli.build_parser().parse_args(["serve", "--model", kimi_ckpt, "--num-scheduler-steps", "8"])
    assert cli.engine_config_from_args(args).num_scheduler_steps == 8


def test_async_scheduling_defaults_to_the_device(kimi_ckpt):
    """Overlap is on by default for CUDA devices (tests/test_gpu_engine.py) and off on the CPU; both flags win."""
    def config(*flags):
        return cli.engine_config_from_args(cli.build_parser().parse_args(["serve", "--model", kimi_ckpt, *flags]))

    assert config().async_scheduling is False
    assert config("--async-scheduling").async_scheduling is True
    assert config("--no-async-scheduling").async_scheduling is False


@pytest.mark.parametrize("text, size", [("1024", 1024), ("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29)])
def test_byte_sizes(text, size):
    assert cli._byte_size(text) == size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_health_and_stops_on_sigint(tmp_path, kimi_ckpt):
    port = _free_port()
    proc = subprocess.Popen(_command() + ["serve", "--model", kimi_ckpt, "--port", str(port), "--no-uvloop"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path))
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "server did not answer /health in 90 s"
                time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
