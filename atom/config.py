"""One typed engine configuration, frozen and validated at construction.

Field names mirror vLLM's engine arguments so flags and keyword arguments
carry over unchanged (``max_num_seqs``, ``max_num_batched_tokens``, ...).
Derived values are properties; nothing here is mutated after construction.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(name: str, hf_config: dict[str, Any]) -> torch.dtype:
    """``auto`` follows the checkpoint's ``torch_dtype``/``dtype``; float16 on CPU becomes float32."""
    if name == "auto":
        name = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
        name = name.replace("torch.", "")
        if name in ("float16", "fp16", "half") and not torch.cuda.is_available():
            name = "float32"
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, float32, bfloat16, float16")
    return _DTYPES[name]


LOAD_FORMATS = ("auto", "safetensors", "dummy")  # safetensors: the same as auto


def load_hf_config(model: str) -> dict[str, Any]:
    """Read ``config.json`` from a checkpoint folder, with errors that name the fix."""
    if not os.path.isdir(model):
        raise ValueError(
            f"model folder {model!r} does not exist; pass a local Hugging Face checkpoint folder "
            "(config.json + *.safetensors)"
        )
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model!r} has no config.json; is it a Hugging Face checkpoint folder?")
    with open(path) as f:
        return json.load(f)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "mtp" | "ngram"
    num_speculative_tokens: int = 1
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown or "method" not in d:
            raise ValueError(f"speculative_config needs 'method' and takes only {sorted(cls.__dataclass_fields__)}; "
                             f"got {sorted(d)}")
        return cls(**d)

    def __post_init__(self) -> None:
        if self.method not in ("mtp", "ngram"):
            raise ValueError(f"speculative method {self.method!r} is not supported; use 'mtp' or 'ngram'")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min must be >= 1 and <= prompt_lookup_max; got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_gpu_blocks: int | None = None  # explicit block count wins over the memory budget
    kv_cache_memory: int | None = None  # bytes for KV blocks + recurrent state slots
    num_state_slots: int | None = None  # defaults to max_num_seqs (+ speculative slots)
    seed: int = 0
    device: str = "cpu"
    tokenizer: str | None = None
    speculative_config: SpeculativeConfig | None = None
    # overlap: plan step N+1 while step N runs. None: on for CUDA devices, where a step's host work (scheduling,
    # inputs, outputs) would otherwise leave the GPU idle, with or without MTP speculation (a row's next
    # verification is planned before its accepted count is known and filled in on the device: 1.12-1.20x the
    # tokens/s on an H200, GPU_NOTES.md session 45); off on the CPU, where both threads share the cores, and with
    # n-gram drafting, whose drafts are made on the host after each step (not measured with overlap on a GPU)
    async_scheduling: bool | None = None
    kv_transfer_config: Any = None  # KVTransferConfig or its dict form (P/D disaggregation)
    enforce_eager: bool = False  # never capture CUDA graphs of decode steps (CPU always runs eagerly)
    num_scheduler_steps: int = 1  # multi-step decoding: up to this many decode steps per scheduling round
    load_format: str = "auto"  # auto: the folder's *.safetensors; dummy: random weights (config.json only)
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.hf_config:
            object.__setattr__(self, "hf_config", load_hf_config(self.model))
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        limit = self.model_max_position
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", min(limit, 4096))
        elif self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        elif self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's maximum of {limit} positions; "
                f"pass --max-model-len {limit} or less"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len})"
            )
        resolve_dtype(self.dtype, self.hf_config)  # validates the name
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; use auto (the folder's *.safetensors) "
                             "or dummy (random weights of the config's shape, for benchmarks)")
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if isinstance(self.kv_transfer_config, dict):
            from atom.kv_transfer.base import KVTransferConfig

            object.__setattr__(self, "kv_transfer_config", KVTransferConfig.from_dict(self.kv_transfer_config))
        device = self._validated_device()
        if self.async_scheduling is None:
            spec = self.speculative_config
            on = device.type == "cuda" and (spec is None or spec.method == "mtp")
            object.__setattr__(self, "async_scheduling", on)
        self._validate_scheduler_steps()

    def _validated_device(self) -> torch.device:
        try:
            device = torch.device(self.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r} is not supported; use --device cpu, cuda or cuda:N")
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise ValueError(f"device {self.device!r}: this torch ({torch.__version__}) sees no CUDA GPU; "
                                 "use --device cpu, or install a CUDA build of torch on a GPU machine")
            if device.index is not None and device.index >= count:
                raise ValueError(f"device {self.device!r}: only {count} CUDA GPU(s) visible; "
                                 f"use cuda:0 to cuda:{count - 1}")
        return device

    def _validate_scheduler_steps(self) -> None:
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.num_scheduler_steps == 1:
            return
        for name, on in (("speculative decoding (speculative_config)", self.speculative_config is not None),
                         ("P/D disaggregation (kv_transfer_config)", self.kv_transfer_config is not None)):
            if on:
                raise ValueError(f"num_scheduler_steps > 1 does not combine with {name}; "
                                 "use --num-scheduler-steps 1 or turn that off")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.hf_config)

    @property
    def model_max_position(self) -> int:
        cfg = self.hf_config
        return int(cfg.get("max_position_embeddings") or cfg.get("model_max_length") or 4096)

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or []
        if not archs:
            raise ValueError(f"{self.model}/config.json names no 'architectures'")
        return archs[0]

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def max_blocks_per_seq(self) -> int:
        # drafts under verification plus as many lookahead positions for chained drafting
        return -(-(self.max_model_len + 2 * self.num_speculative_tokens) // self.block_size)

    @property
    def slots_per_request(self) -> int:
        """Recurrent-state slots one running request holds: one per verifiable position."""
        return 1 + self.num_speculative_tokens

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf_config.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
