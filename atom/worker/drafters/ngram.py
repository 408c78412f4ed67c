"""Prompt-lookup (n-gram) drafting: no weights, only the token history.

Find the most recent earlier occurrence of the history's last n tokens
(longest n first, from prompt_lookup_max down to prompt_lookup_min) and
propose the k tokens that followed it.

The search runs on the request's history as an int64 array that the runner
extends by the new tokens each step (``CachedRequestState.token_array``), not
converted whole from its lists every step (at 4000 tokens that copy alone took
~100 us a row, every step). Any match ends where the history's last token
occurred before: one vector compare finds those places (most rows have none),
and only they are grown back to longer matches, unless the most recent one
already matches at the longest n.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from atom.worker.drafters import DraftContext, Drafter


class NgramDrafter(Drafter):
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, ctx: DraftContext) -> dict[str, list[int]]:
        return {rid: self.lookup(ctx.token_history.array(rid)) for rid in ctx.emitted}

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """The drafts after ``tokens`` (a request's prompt + outputs; int64 array or list)."""
        history = np.asarray(tokens, np.int64)
        end = len(history)
        longest = min(self.max_n, end - 1)
        if longest < self.min_n:
            return []
        # Every earlier match, whatever its n, ends where the last token occurred before (with a token after
        # it); most rows have no such place. Each one's match grows back a token at a time, up to the longest n.
        ends = np.flatnonzero(history[: end - 1] == history[end - 1])
        if not ends.size:
            return []
        # The most recent place, if its match is already the longest possible, is the answer: in repetitive text
        # (where drafts come from) it mostly is, and one compare replaces the growth below.
        last = int(ends[-1])
        suffix = history[end - longest :]
        if last + 1 >= longest and history[last + 1 - longest : last + 1].tobytes() == suffix.tobytes():
            return history[last + 1 : last + 1 + self.k].tolist()
        lengths, alive = np.ones(ends.size, np.int64), np.ones(ends.size, bool)
        for j in range(1, longest):
            alive &= (ends >= j) & (history[ends - j] == history[end - 1 - j])  # (ends - j < 0 wraps: masked)
            if not alive.any():
                break
            lengths += alive
        n = int(lengths.max())  # the longest n with a match
        if n < self.min_n:
            return []
        follows = int(ends[np.flatnonzero(lengths == n)[-1]]) + 1  # its most recent match
        return history[follows : follows + self.k].tolist()
