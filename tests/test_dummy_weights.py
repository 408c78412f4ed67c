"""load_format="dummy": a model's shape from config.json alone, with random weights.

The oracle: the random weights, written out as a checkpoint in the original
spelling, give the same greedy tokens in transformers and in ATOM loading
that checkpoint as ATOM gave with the weights in memory. So every parameter
was filled, the model built from them is the checkpoint's model, and nothing
but the loader differs.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from atom import LLM, SamplingParams
from atom.models.loader import init_dummy_weights
from tests.checkpoints import hf_greedy, make_kimi_checkpoint
from tests.test_cli import _one_line_error, run_cli

PROMPTS = [[5, 17, 42, 9, 100, 7], [3, 250, 11]]


def config_only(src: str, dst: str) -> str:
    """A copy of a checkpoint folder without its weights: config.json and the tokenizer files."""
    os.makedirs(dst)
    for path in glob.glob(os.path.join(src, "*")):
        if not path.endswith(".safetensors") and os.path.isfile(path):
            shutil.copy(path, dst)
    return dst


def save_weights(model: torch.nn.Module, folder: str, hf_name) -> None:
    """The model's parameters as a safetensors checkpoint under their checkpoint names."""
    tensors = {hf_name(name): p.detach().clone().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _greedy(llm: LLM, n: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.fixture(scope="module")
def kimi_mla_first(tmp_path_factory) -> str:
    return make_kimi_checkpoint(str(tmp_path_factory.mktemp("kimi_mla_first")), "mla_first_qlora")


@pytest.mark.parametrize("source, hf_name", [
    ("kimi_ckpt", lambda n: n.replace(".mlp.", ".block_sparse_moe.")),  # the checkpoints' name for Kimi's MLPs
    ("kimi_mla_first", lambda n: n.replace(".mlp.", ".block_sparse_moe.")),
    ("llama_ckpt", lambda n: n),
    ("qwen3_ckpt", lambda n: n),  # tied embeddings
])
def test_dummy_weights_make_the_checkpoints_model(request, tmp_path, make_llm, source, hf_name):
    folder = config_only(request.getfixturevalue(source), str(tmp_path / "shape"))
    llm = make_llm(folder, load_format="dummy")
    tokens = _greedy(llm)
    # not all one token (as zeros would give); a tied-embedding model at random weights repeats its input
    assert len({t for row in tokens for t in row}) > 1, tokens

    saved = config_only(folder, str(tmp_path / "saved"))
    save_weights(llm.engine.runner.model, saved, hf_name)
    assert _greedy(make_llm(saved)) == tokens  # ATOM from the written checkpoint
    assert hf_greedy(saved, PROMPTS, 10) == tokens  # transformers from it


def test_dummy_weights_are_filled_and_repeatable(tmp_path, kimi_ckpt, make_llm):
    folder = config_only(kimi_ckpt, str(tmp_path / "shape"))
    model = make_llm(folder, load_format="dummy").engine.runner.model
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert (p == 1).all(), name
        elif p.dim() >= 2 and not name.endswith("_conv1d.weight") and not name.endswith("A_log"):
            assert 0.015 < p.std() < 0.025, name  # N(0, initializer_range^2)
    for name, p in params.items():
        if name.endswith("A_log"):
            assert ((p.exp() >= 1) & (p.exp() <= 16)).all(), name
        if name.endswith("dt_bias"):
            dt = torch.nn.functional.softplus(p)
            assert ((dt > 0.9e-3) & (dt < 0.11)).all(), name
        if name.endswith("_conv1d.weight"):
            assert p.abs().max() <= 0.5 and p.std() > 0.1, name

    # the engine's seed is the sampler's: the same weights with another
    again = dict(make_llm(folder, load_format="dummy", seed=7).engine.runner.model.named_parameters())
    assert all(torch.equal(params[n], again[n]) for n in params)
    # init_dummy_weights' own seed does change them
    init_dummy_weights(model, seed=1)
    assert not torch.equal(params["model.layers.0.self_attn.q_proj.weight"],
                           again["model.layers.0.self_attn.q_proj.weight"])


def test_dummy_on_a_folder_with_weights_ignores_them(kimi_ckpt, make_llm):
    assert _greedy(make_llm(kimi_ckpt, load_format="dummy")) != _greedy(make_llm(kimi_ckpt))


def test_no_weights_names_the_flag(tmp_path, kimi_ckpt):
    folder = config_only(kimi_ckpt, str(tmp_path / "shape"))
    with pytest.raises(ValueError, match="has no \\*.safetensors files.*--load-format dummy"):
        LLM(folder)
    with pytest.raises(ValueError, match="unknown load_format 'random'; use auto .* or dummy"):
        LLM(folder, load_format="random")


def test_cli_generates_from_a_config_without_weights(tmp_path, kimi_ckpt):
    folder = config_only(kimi_ckpt, str(tmp_path / "shape"))
    result = run_cli(["generate", "--model", folder, "--load-format", "dummy", "--prompt", "Hello",
                      "--max-tokens", "6", "--temperature", "0", "--ignore-eos"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "6 tokens in" in result.stderr
    line = _one_line_error(run_cli(["generate", "--model", folder, "--prompt", "Hello"], tmp_path))
    assert "no *.safetensors files" in line and "--load-format dummy" in line
