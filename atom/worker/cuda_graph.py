"""CUDA graphs of decode and verification steps: captured once per padded batch size, replayed per step.

A decode step launches ~800 small kernels; at small batches the host's launch
time, not the GPU, sets the pace. So at start-up (caches allocated) the
runner captures the model's forward for batch sizes 1, 2, 4, ... up to the
first >= max_num_seqs (at most 512), and a step whose rows are all pure
decode (one token, no drafts, no prompt logprobs) replays the smallest graph
that fits, its batch padded up. Sizes stop where the model's decode path
would sync with the host (``model.graph_capturable``): Kimi-Linear's MoE
past 128 tokens runs grouped matmuls where torch has them (bf16 on Hopper)
and an expert loop elsewhere.

Each size is captured twice where max_model_len is over ``SHORT_CONTEXT``:
for rows of up to that many positions and for rows of up to max_model_len.
Attention sizes its split of long rows over SMs by that bound, and a graph
sized for long rows runs short ones slower: on an H200, MLA decode at batch 1
over 256 positions took 20.0 us a layer with the 126 splits chosen for 32768
positions, 10.7 us with the 4 its own length takes (GPU_NOTES.md, session 39,
call 3). A step replays the graph of the smallest bound that covers its rows.

Each graph ends with the lm_head and the logits' argmax (a greedy step's
tokens): on a slow host each of those launches costs as much as its kernel.
Sampling stays outside the graph (MTP drafting has graphs of its own:
drafters/mtp_graphs.py). Every graph writes its logits
into the first rows of one fp32 buffer [S, V] (at Kimi-Linear's 163840-token
vocabulary a graph of 512 rows alone would hold 335 MB of them): a step reads
them before the next step's replay, as it must for a graph replayed twice.
``--enforce-eager`` turns the graphs off; the CPU always runs eagerly.

With speculative decoding (k drafts) the sizes are captured once more for
verification steps: rows of w = 1 + k tokens ``[t, d1 .. dk]``, as long as a
graph's s * w tokens stay within the largest decode size and the model's
bound (so the static buffers and the logits buffer need no more room). A step
whose rows all decode one token with at most k drafts, some with drafts,
replays one: a row with j < k drafts (or none) is padded to w tokens with
padding tokens, and the runner reads each row's logits at r * w + i. Its KDA
layers keep the state after each token (``state_out_slots + i``), as eager
verification does; the padding tokens' states land in slots of the row's own
group that the scheduler never resumes from (it resumes at the accepted
count, at most j).

The captured forward reads only static device buffers, which each step
overwrites before replay (S = the most tokens, R = the most rows of any
captured graph)::

    rows    [7, S] int64   input_ids | positions | slot_mapping | state_slots
                           | state_out_slots | has_initial_state (0/1) | seq_lens
    tables  [R, max_blocks] int64   block tables (only each row's first blocks are read)

A decode graph of size s reads columns [:s]; a verification graph token
columns [:s * w] (token i of row r in column r * w + i) and its row-level
values (state slots, has_initial_state) in columns [:s]. Padding rows (columns
n..s-1) write nowhere and read no state: slot_mapping -1 (``write_latent_cache``
skips it), state slot -1 (the KDA kernels output zeros and touch no slot),
seq_len 0 (``mla_decode`` attends to nothing). Padding tokens write no cache
and attend to nothing the same way. Every op but KDA's recurrence is
token-wise, and the recurrence only runs forward in a row, so their outputs,
dropped afterwards, cannot reach the real tokens.

What makes the forward capturable (and must stay so): with the ``atom._C``
kernels the layers' pure-decode path has no host sync, makes no tensor from
host data and branches only on shapes and host metadata fixed per size: KDA
takes the whole step as one decode (or verification) group, MLA runs
``mla_decode`` with ``max_seq_len`` = the graph's bound (it only sizes the
split of long sequences; the kernel reads each row's length from
``seq_lens``), MoE a path chosen by the token count alone that never loops
over the experts.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import numpy as np
import torch

from atom.config import EngineConfig
from atom.engine.scheduler_output import ScheduledRequest
from atom.forward_context import AttentionMetadata, ForwardContext, set_forward_context, upload
from atom.layers import attention, mla
from atom.ops._C_loader import use_kernels
from atom.ops.cuda.fused import (HAS_INITIAL_STATE, INPUT_IDS, POSITIONS, SEQ_LENS, SLOT_MAPPING, STATE_OUT_SLOTS,
                                 STATE_SLOTS, advance_decode, settle_verification)

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# the longest verification rows (1 + k tokens) the graphs take: the attention kernels' short-query path
VERIFY_MAX_TOKENS = min(attention.KERNEL_MAX_QUERY_LEN, mla.KERNEL_MAX_QUERY_LEN)
SHORT_CONTEXT = 2048  # the positions a row may reach in the short-context graphs (see above)
# (positions in the step's input ids, int64 device tensor of the ids to write there)
InputPatch = tuple[list[int], torch.Tensor]
# rows of the static int64 buffer: INPUT_IDS, POSITIONS, ... SEQ_LENS (atom.ops.cuda.fused, shared with the kernel)
_PADDING = (0, 0, -1, -1, -1, 0, 0)  # what each row holds in a padding column
_PADDING_COLUMN = np.array(_PADDING, np.int64)[:, None]
# Up to this many block ids (128 KB) a step uploads its rows' whole block tables rather than their first
# columns: a few microseconds on the link, where the strided copy cost the H200's host ~20 us more to launch.
WHOLE_TABLE_ROWS_MAX_IDS = 16384


class DecodeOutput(NamedTuple):
    """A decode graph's outputs, rows [:n] of its static output buffers: valid until the next replay of
    any decode graph (they share the logits buffer), so only work queued on the stream before it may
    read them."""

    hidden: torch.Tensor  # [n, D] the model's last hidden states
    logits: torch.Tensor  # [n, V] float32, the lm_head's
    greedy: torch.Tensor  # [n] int64, the logits' argmax


def capture_sizes(max_num_seqs: int, capturable: Callable[[int], bool] = lambda size: True) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first size >= max_num_seqs, while ``capturable(size)`` holds."""
    sizes = []
    for size in CAPTURE_SIZES:
        if not capturable(size):
            break
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return tuple(sizes)


class DecodeGraphs:
    """The captured decode forwards, their static input buffers, and replay."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, caches: dict, device: torch.device) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.sizes = capture_sizes(config.max_num_seqs, model.graph_capturable)
        if not self.sizes:
            raise ValueError(f"{type(model).__name__}'s decode path syncs with the host even at one row")
        # verification graphs: rows of 1 + k tokens, each size * (1 + k) tokens at most the largest decode size
        self.num_drafts = config.num_speculative_tokens if 1 + config.num_speculative_tokens <= VERIFY_MAX_TOKENS \
            else 0  # fmt: skip
        width = 1 + self.num_drafts

        def verify_capturable(size: int) -> bool:
            return size * width <= CAPTURE_SIZES[-1] and model.graph_capturable(size * width)

        self.verify_sizes = capture_sizes(config.max_num_seqs, verify_capturable) if self.num_drafts else ()
        largest = max((self.sizes[-1], *self.verify_sizes))  # rows
        columns = max((self.sizes[-1], *(size * width for size in self.verify_sizes)))  # tokens
        # a request's block table never outgrows max_model_len (+ lookahead slots); wider steps run eagerly
        self.max_blocks = -(-(config.max_model_len + config.num_speculative_tokens + 1) // config.block_size) + 1
        self.rows = torch.tensor(_PADDING, dtype=torch.long, device=device)[:, None].repeat(1, columns)
        self.tables = torch.zeros(largest, self.max_blocks, dtype=torch.long, device=device)
        self.host_tables = HostBlockTables(max(config.max_num_seqs, largest), self.max_blocks)
        # every graph's logits: rows [:tokens] of this buffer (module docstring)
        self.logits = torch.empty(columns, model.lm_head.out_features, dtype=torch.float32, device=device)
        # the longest row (positions) each set of graphs serves, shortest first
        self.bounds = (SHORT_CONTEXT, self.max_model_len) if self.max_model_len > SHORT_CONTEXT else (
            self.max_model_len,)  # fmt: skip
        # (size, bound, width): width 1 a decode graph, 1 + num_drafts a verification graph
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, DecodeOutput]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per (size, bound, width), most tokens first, sharing one memory pool; every column padding."""
        self.pool = pool = torch.cuda.graph_pool_handle()  # MTP drafting's graphs share it (drafters/mtp_graphs.py)
        shapes = [(size, 1) for size in self.sizes] + [(size, 1 + self.num_drafts) for size in self.verify_sizes]
        shapes.sort(key=lambda shape: shape[0] * shape[1], reverse=True)
        for bound in reversed(self.bounds):
            for size, width in shapes:
                self.graphs[size, bound, width] = capture_graph(lambda: self._forward(size, bound, width), pool)
        torch.cuda.synchronize(self.device)

    def _forward(self, size: int, bound: int, width: int = 1) -> DecodeOutput:
        """The captured forward of ``size`` rows of ``width`` tokens each (token i of row r in column
        r * width + i; the row-level values in columns [:size])."""
        tokens = size * width
        cols = self.rows[:, :tokens]
        with set_forward_context(ForwardContext(self.metadata(size, bound, width), self.caches)):
            hidden = self.model(cols[INPUT_IDS], cols[POSITIONS])
        logits = self.model.compute_logits(hidden, out=self.logits[:tokens])
        return DecodeOutput(hidden, logits, logits.argmax(dim=-1))

    def metadata(self, size: int, bound: int, width: int = 1) -> AttentionMetadata:
        """The attention metadata of a captured step of ``size`` rows of ``width`` tokens, read from the static
        buffers. Its host values describe the captured shape: ``bound`` bounds every seq_len, which is all the
        attention kernels need from the host (to size their splits)."""
        tokens = size * width
        cols = self.rows[:, :tokens]
        meta = AttentionMetadata(
            query_start_loc=list(range(0, tokens + 1, width)),
            context_lens=[bound - width] * size,
            seq_lens=[bound] * size,
            block_tables=self.tables[:size],
            slot_mapping=cols[SLOT_MAPPING],
            state_slots=cols[STATE_SLOTS, :size],
            block_size=self.block_size,
            state_out_slots=cols[STATE_OUT_SLOTS, :size],
            per_token_state_seqs=tuple(range(size)) if width > 1 else (),
        )
        # Device values derived inside the graph from the static rows (the properties would
        # otherwise upload the host lists above, which hold bounds, not this step's values).
        meta.has_initial_state = cols[HAS_INITIAL_STATE, :size] != 0
        meta.token_seq_lens = cols[SEQ_LENS].to(torch.int32)
        seq_ids = torch.arange(tokens, device=self.device)
        meta.token_seq_ids = seq_ids if width == 1 else seq_ids // width
        return meta

    def forget(self, request_ids) -> None:
        """These requests' block tables were freed or resent (finished, preempted, new)."""
        self.host_tables.forget(request_ids)

    def covers(self, rows: list[ScheduledRequest]) -> bool:
        """A step the graphs can run: pure decode, no drafts or prompt logprobs, small enough."""
        return (
            len(rows) <= self.sizes[-1]
            and all(len(s.token_ids) == 1 and not s.draft_token_ids and not s.prompt_logprobs for s in rows)
            and max(len(s.block_ids) for s in rows) <= self.max_blocks
        )

    def replay(self, input_ids: list[int], rows: list[ScheduledRequest],
               patch: InputPatch | None = None) -> DecodeOutput:  # fmt: skip
        """The step's n rows' hidden states, logits and greedy tokens (views into the graph's output
        buffers). ``patch``: input ids still on the device, written over theirs (a chained async
        step's placeholders, atom/worker/deferred.py)."""
        size, n = self._fill(input_ids, rows, patch), len(rows)
        return DecodeOutput(*(x[:n] for x in self._launch(size, self.bound_for(rows))))

    def covers_verification(self, rows: list[ScheduledRequest]) -> bool:
        """A speculative verification step the graphs can run: some row with drafts, every row one
        token and up to ``num_drafts`` drafts (no prefill, no prompt logprobs), small enough."""
        return (
            bool(self.verify_sizes)
            and len(rows) <= self.verify_sizes[-1]
            and any(s.draft_token_ids for s in rows)
            and all(len(s.token_ids) == 1 + len(s.draft_token_ids) <= 1 + self.num_drafts
                    and not s.prompt_logprobs for s in rows)  # fmt: skip
            and max(len(s.block_ids) for s in rows) <= self.max_blocks
        )

    def replay_verification(self, input_ids: list[int], rows: list[ScheduledRequest],
                            settle: tuple[list, object] | None = None) -> DecodeOutput:  # fmt: skip
        """A verification step's outputs for rows [t, d1 .. dj] of up to 1 + num_drafts tokens: row r's
        token i at r * (1 + num_drafts) + i (views into the graph's output buffers). Rows with fewer
        drafts are padded with tokens that write no cache and attend to nothing. ``settle``: rows to make
        right on the device from the step before's outcome (``_settle``'s arguments)."""
        width = 1 + self.num_drafts
        size = fill_decode_buffers(self.rows, self.tables, self.host_tables, input_ids, rows, self.verify_sizes,
                                   self.block_size, width)  # fmt: skip
        if settle is not None:
            self._settle(*settle)
        longest = max(s.context_len + len(s.token_ids) for s in rows)
        n = len(rows) * width
        return DecodeOutput(*(x[:n] for x in self._launch(size, self.bound(longest), width)))

    def _settle(self, rows: list[tuple[int, int]], previous) -> None:
        """Verification rows planned while the step before ran (``ScheduledRequest.after_inflight``), filled in
        as if that step had accepted every draft, made right on the device from its outcome (``previous``: a
        ``deferred.DeferredVerification``; ``fused.settle_verification``). ``rows``: (this step's row, its row
        in ``previous``) for each; every such row has 1 + num_drafts tokens."""
        index = upload([*(r for r, _ in rows), *(c for _, c in rows), *(previous.planned[c] for _, c in rows)],
                       torch.long, self.device)  # fmt: skip
        settle_verification(self.rows, self.tables, index, previous.packed, previous.n, previous.width,
                            self.block_size)  # fmt: skip

    def replay_steps(self, input_ids: list[int], rows: list[ScheduledRequest], num_steps: int,
                     patch: InputPatch | None = None) -> torch.Tensor:  # fmt: skip
        """Multi-step greedy decoding on the device: ``num_steps`` replays back to back, each row's
        next input being the greedy token of the replay before, with positions, slots and lengths
        advanced on the device: no host sync between steps.
        Returns the tokens, int64 [num_steps, n] on the device."""
        n = len(rows)
        size = self._fill(input_ids, rows, patch)
        bound = self.bound_for(rows, num_steps)  # the round's last step included
        tokens = torch.empty(num_steps, n, dtype=torch.long, device=self.device)
        for step in range(num_steps):
            if step:  # positions, slots and lengths one step on, input the tokens just sampled
                advance_decode(self.rows, self.tables, tokens[step - 1], self.block_size)
            tokens[step] = self._launch(size, bound).greedy[:n]
        return tokens

    def bound_for(self, rows: list[ScheduledRequest], num_steps: int = 1) -> int:
        """The smallest bound over every row's length in the next ``num_steps`` steps."""
        return self.bound(max(s.context_len for s in rows) + num_steps)

    def bound(self, longest: int) -> int:
        """The smallest bound of at least ``longest`` positions (the largest where none is)."""
        return next((b for b in self.bounds if b >= longest), self.bounds[-1])

    def _fill(self, input_ids: list[int], rows: list[ScheduledRequest], patch: InputPatch | None) -> int:
        size = fill_decode_buffers(self.rows, self.tables, self.host_tables, input_ids, rows, self.sizes,
                                   self.block_size)
        if patch is not None:
            positions, values = patch
            self.rows[INPUT_IDS, as_index(positions, self.device)] = values
        return size

    def _launch(self, size: int, bound: int | None = None, width: int = 1) -> DecodeOutput:
        """Replays the graph of this size, bound (by default the shortest: a short-context step's) and width
        over the static buffers; its output buffers (all ``size * width`` tokens)."""
        graph, outputs = self.graphs[size, self.bounds[0] if bound is None else bound, width]
        graph.replay()
        return outputs


class HostBlockTables:
    """Each decoding request's block table kept on the host between steps, so that a step
    writes only the blocks added since the request's last step, not every table in full
    (at 32k tokens of context that was 2,000 block ids a request, each step).

    Sound because the scheduler only ever appends to a request's block list until it frees
    it; every free reaches the runner as a finished or preempted id, and a resent request
    as new: ``forget`` drops those ids' tables.
    """

    def __init__(self, rows: int, max_blocks: int) -> None:
        self.table = torch.zeros(rows, max_blocks, dtype=torch.long)
        self._array = self.table.numpy()  # the same memory: numpy gathers rows faster than torch indexes them
        self._known: dict[str, tuple[int, int]] = {}  # request id -> (row, blocks written)
        self._free = list(range(rows - 1, -1, -1))

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            known = self._known.pop(request_id, None)
            if known is not None:
                self._free.append(known[0])

    def gather(self, rows: list[ScheduledRequest], width: int) -> torch.Tensor:
        """The step's block tables, [len(rows), width], zero past each row's blocks."""
        index = []
        for s in rows:
            known = self._known.get(s.request_id)
            if known is None or known[1] != len(s.block_ids):
                known = self._write(s, known, rows)
            index.append(known[0])
        return torch.from_numpy(self._array[index, :width])

    def _write(self, s: ScheduledRequest, known: tuple[int, int] | None,
               rows: list[ScheduledRequest]) -> tuple[int, int]:  # fmt: skip
        """Writes the blocks of s not yet in its row (a new row for a request not seen yet)."""
        row, written = known if known is not None else (self._take_row(rows), -1)
        n = len(s.block_ids)
        if n < written or written < 0:  # a new row, or (not possible between forgets) a shorter list
            self.table[row].zero_()  # past a row's blocks it holds zeros
            written = 0
        self.table[row, written:n] = torch.tensor(s.block_ids[written:n], dtype=torch.long)
        self._known[s.request_id] = (row, n)
        return row, n

    def _take_row(self, rows: list[ScheduledRequest]) -> int:
        if not self._free:  # every row taken: drop the requests this step does not run
            running = {s.request_id for s in rows}
            self.forget([rid for rid in list(self._known) if rid not in running])
        return self._free.pop()


def capture_graph(forward: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """``forward`` captured into a graph in memory ``pool``, with its outputs; run once before, outside the
    capture, for lazy initialisation (cuBLAS handles, kernel attributes)."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = forward()
    return graph, outputs


def fill_decode_buffers(buffers: torch.Tensor, tables: torch.Tensor, host_tables: HostBlockTables,
                        input_ids: list[int], rows: list[ScheduledRequest], sizes: tuple[int, ...],
                        block_size: int, width: int = 1, num_tokens: list[int] | None = None) -> int:  # fmt: skip
    """Writes a step's n rows into the static buffers (every column past them as padding); the graph
    size to replay. The whole of ``buffers`` goes up in one contiguous copy: on a GPU that is one
    transfer, where its first columns alone would be a transfer and a strided copy kernel.

    ``width`` 1: decode rows, one token each. Otherwise verification rows ``[t, d1 .. dj]`` of up to
    ``width`` tokens each, row r's token i in column r * width + i; a row's columns past its tokens are
    padding (no cache write, seq_len 0) and its row-level values sit in column r. ``num_tokens``: each
    row's count of ``input_ids`` where it is not ``len(token_ids)`` (MTP drafting's fill)."""
    n = len(rows)
    size = next(s for s in sizes if s >= n)
    columns = max(len(s.block_ids) for s in rows)
    if n * tables.shape[1] <= WHOLE_TABLE_ROWS_MAX_IDS:  # whole rows: contiguous, so again one plain transfer
        columns = tables.shape[1]
    table = host_tables.gather(rows, columns)
    host = np.empty(tuple(buffers.shape), np.int64)
    host[:] = _PADDING_COLUMN
    context = np.fromiter((s.context_len for s in rows), np.int64, n)
    if width == 1:
        row_of, positions, cols = np.arange(n), context, slice(0, n)
    else:  # row r's token j: column r * width + j, position context_len + j
        counts = num_tokens if num_tokens is not None else (len(s.token_ids) for s in rows)
        lens = np.fromiter(counts, np.int64, n)
        row_of = np.repeat(np.arange(n), lens)
        j = np.arange(len(row_of)) - np.repeat(np.cumsum(lens) - lens, lens)
        cols, positions = row_of * width + j, context[row_of] + j
    host[INPUT_IDS, cols] = input_ids
    host[POSITIONS, cols] = positions
    host[SLOT_MAPPING, cols] = table.numpy()[row_of, positions // block_size] * block_size + positions % block_size
    host[SEQ_LENS, cols] = positions + 1
    host[STATE_SLOTS, :n] = [s.state_slot for s in rows]
    host[STATE_OUT_SLOTS, :n] = [s.state_out_slot for s in rows]
    host[HAS_INITIAL_STATE, :n] = context > 0
    copy_from_host(buffers, torch.from_numpy(host))
    copy_from_host(tables[:n, :columns], table)
    return size


def copy_from_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    """``dst[...] = host`` without waiting for the stream. From pageable memory a copy to the GPU
    first waits for every kernel queued before it, so with async scheduling the next step could not
    be filled in (nor launched) until the step before had finished. On a GPU the values go through
    pinned memory instead; torch's caching host allocator keeps that buffer until the copy has run."""
    if dst.device.type == "cuda":
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)


def as_index(positions: list[int], device: torch.device) -> slice | torch.Tensor:
    """positions as a tensor index: a slice when they are one contiguous run (a view: no upload, no
    gather or scatter kernel; the usual case in decode), else a device tensor (uploaded without
    waiting for the stream)."""
    if positions == list(range(positions[0], positions[0] + len(positions))):
        return slice(positions[0], positions[0] + len(positions))
    return upload(positions, torch.long, device)


def capture_decode_graphs(config: EngineConfig, model: torch.nn.Module, caches: dict) -> DecodeGraphs | None:
    """Captured decode graphs, or None where decode runs eagerly (CPU, --enforce-eager, no kernels,
    a model whose decode path cannot be captured, or a capture that failed: logged)."""
    device = torch.device(config.device)
    if device.type != "cuda" or config.enforce_eager:
        return None
    if not use_kernels():
        logger.info("CUDA graphs off: the atom._C kernels are not in use, and the torch reference "
                    "layers sync with the host")
        return None
    if not model.supports_cuda_graphs or not model.graph_capturable(1):
        logger.info("CUDA graphs off: %s's decode path is not capturable", type(model).__name__)
        return None
    graphs = DecodeGraphs(config, model, caches, device)
    try:
        graphs.capture()
    except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager decode
        logger.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(e).__name__, e)
        return None
    logger.info("captured CUDA graphs of decode steps for batch sizes %s, rows of up to %s positions",
                ", ".join(map(str, graphs.sizes)), " or ".join(map(str, graphs.bounds)))
    if graphs.verify_sizes:
        logger.info("captured CUDA graphs of verification steps (%d tokens a row) for batch sizes %s",
                    1 + graphs.num_drafts, ", ".join(map(str, graphs.verify_sizes)))
    elif config.num_speculative_tokens and not graphs.num_drafts:
        logger.info("verification steps run eagerly: %d tokens a row is past the attention kernels' %d",
                    1 + config.num_speculative_tokens, VERIFY_MAX_TOKENS)
    if config.max_num_seqs > graphs.sizes[-1]:
        logger.info("decode steps of more than %d rows run eagerly (%s)", graphs.sizes[-1],
                    "the largest size captured" if graphs.sizes[-1] == CAPTURE_SIZES[-1]
                    else f"{type(model).__name__}'s decode path syncs with the host past it")  # fmt: skip
    return graphs
