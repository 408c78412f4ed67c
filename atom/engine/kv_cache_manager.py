"""Paged KV block pool with prefix caching, and the recurrent-state slot pool.

Blocks: a block is *full* once ``block_size`` of its tokens are computed; a
full block gets a hash chained on its predecessor's, so equal prefixes map to
equal hash chains. Freed blocks keep their hash and contents until reused, so
a later request with the same prefix can take them back (prefix hit). Free
blocks are reused least-recently-freed first.

State slots: a KDA state is valid for exactly one token count and cannot be
shared between requests, so each running request owns a group of
``slots_per_group`` slots (1 + speculative tokens) from admission until it
finishes, is aborted or is preempted.

Every call returns a result or None; the scheduler owns the policy.
"""

from __future__ import annotations

from collections import OrderedDict

from atom.engine.request import Request


def hash_block(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        # Free blocks in eviction order (oldest first); values unused.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def touch(self, block: int) -> None:
        """Take a reference on a cached block (a prefix hit)."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Tail blocks first, so the least useful part of a prefix is evicted first.
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free[block] = None

    def register(self, block: int, block_hash: int) -> None:
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]


class StateSlotPool:
    def __init__(self, num_groups: int, slots_per_group: int) -> None:
        self.num_groups = num_groups
        self.slots_per_group = slots_per_group
        self.free_groups = list(range(num_groups - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_groups)

    def take(self) -> int | None:
        """First slot of a free group, or None."""
        if not self.free_groups:
            return None
        return self.free_groups.pop() * self.slots_per_group

    def release(self, first_slot: int) -> None:
        group = first_slot // self.slots_per_group
        assert group not in self.free_groups, f"state slot group {group} freed twice"
        self.free_groups.append(group)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_state_groups: int = 0,
        slots_per_group: int = 1,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.states = StateSlotPool(num_state_groups, slots_per_group)
        self.uses_state = num_state_groups > 0
        self.enable_prefix_caching = enable_prefix_caching

    # -- blocks --------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the request's prefix, and how many tokens they cover.

        At least one prompt token is always left to compute: its logits give
        the first output token.
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], 0
        self._update_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in request.block_hashes[:max_hit_blocks]:
            block = self.blocks.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks allocate_slots(request, num_new_tokens) would take (no prefix hits)."""
        need_tokens = request.num_computed_tokens + num_new_tokens
        return max(-(-need_tokens // self.block_size) - len(request.block_ids), 0)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> list[int] | None:
        """Make the request's blocks cover its computed + new tokens; the new block ids, or None."""
        need_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = -(-need_tokens // self.block_size) - len(request.block_ids) - len(cached_blocks)
        if need <= 0 and not cached_blocks:
            return []  # the common decode step: the last block still has room
        free_after_hits = self.blocks.num_free - sum(1 for b in cached_blocks if self.blocks.ref_counts[b] == 0)
        if need > free_after_hits:
            return None
        for block in cached_blocks:
            self.blocks.touch(block)
        request.block_ids.extend(cached_blocks)
        new = self.blocks.take(max(need, 0)) or []
        request.block_ids.extend(new)
        return new

    def cache_full_blocks(self, request: Request) -> None:
        """Register hashes for blocks whose tokens are all computed.

        Each block is offered once, when it fills (every step re-offering all of a request's blocks cost
        O(context) a step). A block whose hash another block holds already stays unregistered."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(request.num_offered_blocks, num_full):
            self.blocks.register(request.block_ids[i], request.block_hashes[i])
        request.num_offered_blocks = max(request.num_offered_blocks, num_full)

    def _update_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        while (len(hashes) + 1) * bs <= request.num_tokens:  # a new full block of known tokens
            i = len(hashes)
            block = tuple(request.token_ids_between(i * bs, (i + 1) * bs))
            hashes.append(hash_block(hashes[-1] if hashes else None, block))

    # -- state slots -----------------------------------------------------------
    def allocate_state(self, request: Request) -> bool:
        """Give the request a state-slot group if the model has recurrent layers."""
        if not self.uses_state or request.state_slot is not None:
            return True
        slot = self.states.take()
        if slot is None:
            return False
        request.state_slot = slot
        return True

    # -- release ---------------------------------------------------------------
    def free(self, request: Request) -> None:
        self.blocks.release(request.block_ids)
        request.block_ids = []
        request.num_offered_blocks = 0
        if request.state_slot is not None:
            self.states.release(request.state_slot)
            request.state_slot = None

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def block_usage(self) -> float:
        return 1.0 - self.blocks.num_free / max(self.blocks.num_blocks, 1)

    @property
    def state_usage(self) -> float:
        return 1.0 - self.states.num_free / max(self.states.num_groups, 1) if self.uses_state else 0.0

    def all_free(self) -> bool:
        return self.blocks.num_free == self.blocks.num_blocks and self.states.num_free == self.states.num_groups
