"""Draft proposers for speculative decoding, chosen by ``speculative_config.method``.

A drafter runs on the worker side after a step's tokens are known and
proposes up to ``num_speculative_tokens`` tokens per request for the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch


class TokenHistories(Mapping):
    """Request id -> its prompt + outputs, joined only for the rows a drafter asks for (MTP reads a few
    tokens a row: joining every row's whole history each step would cost more than its drafting at long
    contexts). ``arrays``: request id -> the same as an int64 array, where the runner keeps one up to date
    (``array``)."""

    def __init__(self, parts: dict[str, tuple[list[int], list[int]]],
                 arrays: Callable[[str], np.ndarray] | None = None) -> None:  # fmt: skip
        self._parts = parts  # request id -> (prompt, outputs)
        self._arrays = arrays

    def array(self, request_id: str) -> np.ndarray:
        """The history as an int64 array (converted from the lists where no ``arrays`` came)."""
        if self._arrays is not None:
            return self._arrays(request_id)
        return np.asarray(self[request_id], np.int64)

    def __getitem__(self, request_id: str) -> list[int]:
        prompt, outputs = self._parts[request_id]
        return prompt + outputs

    def __iter__(self):
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def span(self, request_id: str, start: int, stop: int) -> list[int]:
        """history[start:stop], without joining the whole history."""
        prompt, outputs = self._parts[request_id]
        if start >= len(prompt):
            return outputs[start - len(prompt) : stop - len(prompt)]
        return prompt[start:stop] + outputs[: max(0, stop - len(prompt))]


class Drafter:
    """What the runner asks of a drafter; each drafter has its own ``propose``."""

    def propose(self, ctx: DraftContext) -> dict[str, list[int]]:
        """Up to k drafts for each row that produced tokens this step."""
        raise NotImplementedError

    def capture_graphs(self, decode_graphs) -> None:
        """Capture CUDA graphs of its drafting beside the runner's ``decode_graphs`` (None where it has none).
        By default there is nothing to capture."""

    def draft_after_verification(self, rows: list, targets: tuple | None = None) -> torch.Tensor | None:
        """Right behind a verification step on the graphs whose rows all verify on the device: the rows' drafts
        [k, n] on the device, drafted before the host has seen the step's tokens. Each row's accepted drafts
        and next token are read from the verification graph's argmax, but for the rows in ``targets``:
        (their indices, their ``spec_decode.Verdict.targets``), the rows that sample (or have penalties or
        logprobs). None (the default): the runner calls ``propose`` once the host has the step's tokens."""
        return None

    @property
    def drafts_behind_graphs(self) -> bool:
        """Whether it drafts right behind verification graphs at all (``draft_after_verification``)."""
        return False

    def drafts_behind(self, rows: list) -> bool:
        """Whether ``draft_after_verification`` would draft for a verification step of these rows on the graphs
        (the runner's overlap plans on it). False by default."""
        return False


@dataclass
class DraftContext:
    """What a drafter may look at after one step."""

    rows: list  # ScheduledRequest, in batch order
    query_start_loc: list[int]
    hidden_states: torch.Tensor  # [T, D] the target's final hidden states for the step
    emitted: dict[str, list[int]]  # request id -> tokens produced this step
    token_history: Mapping[str, list[int]]  # every row's prompt + outputs, including emitted (TokenHistories)
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
