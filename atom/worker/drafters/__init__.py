"""Draft proposers for speculative decoding, chosen by ``speculative_config.method``.

A drafter runs on the worker side after a step's tokens are known and
proposes up to ``num_speculative_tokens`` tokens per request for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftContext:
    """What a drafter may look at after one step."""

    rows: list  # ScheduledRequest, in batch order
    query_start_loc: list[int]
    hidden_states: torch.Tensor  # [T, D] the target's final hidden states for the step
    emitted: dict[str, list[int]]  # request id -> tokens produced this step
    token_history: dict[str, list[int]]  # every row's prompt + outputs, including emitted
    caches: dict = field(default_factory=dict)  # the runner's cache tensors by layer
    block_size: int = 16


def make_drafter(config, model):
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        from atom.worker.drafters.ngram import NgramDrafter

        return NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from atom.worker.drafters.mtp import MTPDrafter

    return MTPDrafter(config, model)
