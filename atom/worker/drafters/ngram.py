"""Prompt-lookup (n-gram) drafting: no weights, only the token history.

Find the most recent earlier occurrence of the history's last n tokens
(longest n first, from prompt_lookup_max down to prompt_lookup_min) and
propose the k tokens that followed it.
"""

from __future__ import annotations

from atom.worker.drafters import DraftContext


class NgramDrafter:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, ctx: DraftContext) -> dict[str, list[int]]:
        return {rid: self.lookup(ctx.token_history[rid]) for rid in ctx.emitted}

    def lookup(self, tokens: list[int]) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # scan right to left for the most recent match that has a continuation
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + self.k]
        return []
