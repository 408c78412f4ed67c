"""Clients that walk away mid-stream, for the tests of aborts while steps are in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


async def stream_and_walk_away(engine, prompts: list, params,
                               walks_away: Callable[[int, list[int]], bool]) -> list[list[int] | None]:  # fmt: skip
    """Streams every prompt at once through ``engine`` (an AsyncEngine). Client i stops reading (closing
    its stream aborts the request) as soon as ``walks_away(i, tokens so far)``, and gets None; the others
    get their tokens. Then waits, bounded, until every block and slot is free, and asserts it."""

    async def one(i, prompt) -> list[int] | None:
        tokens: list[int] = []
        async with contextlib.aclosing(engine.generate(prompt, params)) as stream:
            async for out in stream:
                tokens += out.new_token_ids
                if walks_away(i, tokens):
                    return None
        return tokens

    got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    for _ in range(100):  # the aborts land between steps
        if engine.all_resources_free():
            break
        await asyncio.sleep(0.05)
    assert engine.all_resources_free()
    return list(got)


def assert_walked_away(got: list[list[int] | None], reference: list[list[int]],
                       walked: Callable[[int], bool]) -> None:  # fmt: skip
    """``stream_and_walk_away``'s result: None for the clients that walked away, the reference tokens for the
    others."""
    for i, tokens in enumerate(got):
        assert (tokens is None) == walked(i)
        if tokens is not None:
            assert tokens == reference[i]
