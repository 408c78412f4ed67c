"""Build a model from a Hugging Face checkpoint folder (config.json + *.safetensors).

Model parameters carry the checkpoint's tensor names; a model may rename or
skip names through ``hf_name_map(name) -> str | None``. Every parameter must
be loaded exactly once with the right shape, or loading fails naming the
tensor and the file.
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
        raise ValueError(f"{folder!r} has no *.safetensors files; save the model with save_pretrained()")
    return files


def load_model(config: EngineConfig) -> torch.nn.Module:
    cls = get_model_class(config.architecture)
    dtype = config.torch_dtype
    with torch.device("meta"):
        model = cls(config.hf_config, dtype)
    model = model.to_empty(device=config.device)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    required = set(dict(model.named_parameters())) | set(getattr(model, "required_buffers", ()))
    loaded: set[str] = set()
    name_map = getattr(model, "hf_name_map", lambda n: n)
    files = _checkpoint_files(config.model)
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
