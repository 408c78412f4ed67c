"""Build a model from a Hugging Face checkpoint folder (config.json + *.safetensors).

Model parameters carry the checkpoint's tensor names; a model may rename or
skip names through ``hf_name_map(name) -> str | None``. Every parameter must
be loaded exactly once with the right shape, or loading fails naming the
tensor and the file.

``load_format="dummy"`` (vLLM's name) reads config.json only and fills the
parameters with random values instead, as transformers initialises a fresh
model: for benchmarks and smoke runs of a model's shape (Kimi-Linear-48B-A3B's
weights are ~98 GB) without its checkpoint.
"""

from __future__ import annotations

import glob
import os
import sys

import torch
from safetensors import safe_open
from tqdm import tqdm

from atom.config import EngineConfig
from atom.models.registry import get_model_class


def _checkpoint_files(folder: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"{folder!r} has no *.safetensors files; save the model with save_pretrained(), or pass "
                         "--load-format dummy (load_format='dummy') to run its shape with random weights")
    return files


def load_model(config: EngineConfig) -> torch.nn.Module:
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config.hf_config, config.torch_dtype)
    model = model.to_empty(device=config.device)
    required = set(dict(model.named_parameters())) | set(getattr(model, "required_buffers", ()))
    if config.load_format == "dummy":
        loaded = init_dummy_weights(model, std=float(config.hf_config.get("initializer_range", 0.02)))
    else:
        loaded = _load_checkpoint(model, config.model)
    if hasattr(model, "tie_weights"):
        loaded |= model.tie_weights()
    missing = sorted(required - loaded)
    if missing:
        raise ValueError(
            f"checkpoint {config.model!r} is missing tensor(s) {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} required by {cls.__name__}"
        )
    if hasattr(model, "post_load"):
        model.post_load()
    return model.eval()


def _load_checkpoint(model: torch.nn.Module, folder: str) -> set[str]:
    """Copies every tensor of the folder's safetensors files into its parameter; the names loaded."""
    cls = type(model)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    loaded: set[str] = set()
    name_map = getattr(model, "hf_name_map", lambda n: n)
    files = _checkpoint_files(folder)
    show = sys.stderr.isatty()
    for path in tqdm(files, desc="Loading weights", disable=not show, unit="file"):
        with safe_open(path, framework="pt") as f:
            for hf_name in f.keys():
                name = name_map(hf_name)
                if name is None:
                    continue
                if name not in params:
                    raise ValueError(
                        f"unexpected tensor {hf_name!r} in {os.path.basename(path)}: "
                        f"{cls.__name__} has no parameter {name!r}"
                    )
                tensor = f.get_tensor(hf_name)
                target = params[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"tensor {hf_name!r} in {os.path.basename(path)} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(target.shape)} for {cls.__name__}"
                    )
                with torch.no_grad():
                    target.copy_(tensor.to(target.dtype))
                loaded.add(name)
    return loaded


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> set[str]:
    """Random parameters in place of a checkpoint, drawn on the model's device from ``seed`` (not the
    engine's seed, which is the sampler's: a model does not change with it): matrices
    (linears, embeddings, experts, routers) from N(0, std^2), norm weights 1, other vectors (biases) 0,
    unless the model's ``dummy_init(name, param, generator)`` fills a parameter itself (returns True).
    The same seed on the same device gives the same weights. The names filled."""
    own = getattr(model, "dummy_init", lambda name, param, generator: False)
    params = dict(model.named_parameters())
    generator = torch.Generator(device=next(iter(params.values())).device).manual_seed(seed)
    for name, param in params.items():
        if own(name, param, generator):
            continue
        if param.dim() >= 2:
            param.normal_(0.0, std, generator=generator)
        elif "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:  # the owning module's name: input_layernorm...
            param.fill_(1.0)
        else:
            param.zero_()
    return set(params)
