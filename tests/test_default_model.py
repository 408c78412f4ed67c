"""The bundled default model: built offline, byte-identical every time, runs in ATOM and in transformers."""

from __future__ import annotations

import hashlib
import os

import pytest

from atom.default_model import default_model_path
from tests.test_cli import run_cli


def _digests(folder: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    """A cache folder with the default model built in it; tests point ATOM_CACHE_DIR there."""
    cache = tmp_path_factory.mktemp("atom-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATOM_CACHE_DIR", str(cache))
        default_model_path()
    return str(cache)


def test_build_is_deterministic_and_cached(built, tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE_DIR", built)
    first = default_model_path()
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    assert default_model_path() == first  # reused, not rebuilt
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
    assert [n for n in os.listdir(built) if n.startswith(".")] == []  # no temporary folders left behind

    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    second = default_model_path()
    assert second != first
    assert _digests(first) == _digests(second)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(_digests(first))


def test_atom_and_transformers_agree_on_it(built, monkeypatch, make_llm):
    from atom import SamplingParams
    from tests.checkpoints import hf_greedy

    monkeypatch.setenv("ATOM_CACHE_DIR", built)
    path = default_model_path()
    llm = make_llm(path)
    assert llm.config.architecture == "KimiLinearForCausalLM"
    assert llm.config.eos_token_ids == (llm.get_tokenizer().convert_tokens_to_ids("</s>"),)
    prompts = [llm.get_tokenizer().encode("Hello, world"), llm.get_tokenizer().encode("The quick brown fox")]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert ours == hf_greedy(path, prompts, 6)


def test_generate_without_model_uses_it_offline(built, tmp_path):
    env_cache = tmp_path / "cache"
    os.symlink(built, env_cache)  # run_cli points ATOM_CACHE_DIR at tmp_path/cache
    result = run_cli(["generate", "--prompt", "Hello, world", "--max-tokens", "4", "--ignore-eos"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "default model" in result.stderr and str(env_cache) in result.stderr
    assert "4 tokens in" in result.stderr
