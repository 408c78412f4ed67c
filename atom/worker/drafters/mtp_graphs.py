"""MTP drafting on CUDA graphs: a step's fill and its k chained drafts in one replay.

Eagerly, MTP drafting after a step costs a fill (one MLA layer over the
step's valid positions, its attention metadata built and uploaded on the
host), then for each of k drafts an lm_head, an argmax and a copy to the host,
and k - 1 more forwards of the layer: at small batches several times the
launches of the verification step on the graphs that it feeds. So next to
each verification graph (rows of w = 1 + k tokens, atom/worker/cuda_graph.py)
the drafter captures, per size and bound, the whole of its drafting over the
decode graphs' static buffers::

    fill   row r's valid positions (1 + the drafts it accepted, v_r <= w) in
           columns r*w .. r*w + v_r - 1 of the rows buffer, each with the token
           after it (fill_decode_buffers), and the target's hidden state at each
           in ``self.hidden``; the other columns are padding (slot -1, seq_len 0)
    last   column r*w + v_r - 1, v_r counted on the device (seq_len > 0)
    chain  depth d = 1 .. k-1: row r's draft d at position p_r + d (p_r its last
           valid position), its slot looked up in the block table on the device;
           a padding row (v_r = 0) writes nowhere and attends to nothing
    out    drafts [k, size] int64: one copy to the host

The graph writes the MTP layer's cache at the positions the eager path writes
(the fill's, then the chain's lookahead positions, which the next fill
overwrites), so the two paths give the same drafts. Steps with other rows (a
prefill chunk, more rows than the largest verification graph) draft eagerly.
"""

from __future__ import annotations

import logging

import torch

from atom.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from atom.ops.cuda.fused import INPUT_IDS, POSITIONS, SEQ_LENS, STATE_SLOTS
from atom.worker.cuda_graph import DecodeGraphs, as_index, fill_decode_buffers

logger = logging.getLogger(__name__)


class MTPGraphs:
    """MTP drafting captured per (size, bound) of the decode graphs' verification sizes, and its replay."""

    def __init__(self, model: torch.nn.Module, decode_graphs: DecodeGraphs, k: int) -> None:
        if decode_graphs.num_drafts != k or not decode_graphs.verify_sizes:
            raise ValueError(f"no verification graphs of {k} drafts to draft beside")
        self.model, self.decode, self.k = model, decode_graphs, k
        self.width = 1 + k
        self.sizes = decode_graphs.verify_sizes
        head = model.lm_head
        # the target's hidden states at each fill position, laid out as the fill's columns
        self.hidden = torch.zeros(self.sizes[-1] * self.width, head.in_features, dtype=head.weight.dtype,
                                  device=decode_graphs.device)  # fmt: skip
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per (size, bound), most rows first, in the decode graphs' memory pool."""
        device = self.decode.device
        for bound in reversed(self.decode.bounds):
            for size in reversed(self.sizes):
                self._forward(size, bound)  # warm-up outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.decode.pool):
                    drafts = self._forward(size, bound)
                self.graphs[size, bound] = (graph, drafts)
        torch.cuda.synchronize(device)

    def covers(self, ctx, fills) -> bool:
        """Drafting the graphs can run: every row produced tokens (no prefill chunk) from at most w valid
        positions, no more rows than the largest size, and block tables and positions within the graphs'."""
        return (
            len(fills) <= self.sizes[-1]
            and all(f.row.request_id in ctx.emitted and len(f.ids) <= self.width for f in fills)
            and max(len(f.row.block_ids) for f in fills) <= self.decode.max_blocks
            and self._longest(fills) <= self.decode.bounds[-1]
        )

    def propose(self, ctx, fills) -> dict[str, list[int]]:
        """Each row's k drafts (the rows ``covers`` accepted)."""
        decode, n = self.decode, len(fills)
        counts = [len(f.ids) for f in fills]
        size = fill_decode_buffers(decode.rows, decode.tables, decode.host_tables, [t for f in fills for t in f.ids],
                                   [f.row for f in fills], self.sizes, decode.block_size, self.width, counts)
        self._copy_hidden(ctx.hidden_states, fills, counts)
        drafts = self._launch(size, decode.bound(self._longest(fills)))[:, :n].cpu()
        return {f.row.request_id: column for f, column in zip(fills, drafts.T.tolist())}

    def _longest(self, fills) -> int:
        """The most positions a row reaches: its last valid one, then k - 1 chained drafts."""
        return max(f.context + len(f.ids) for f in fills) + self.k - 1

    def _copy_hidden(self, hidden: torch.Tensor, fills, counts: list[int]) -> None:
        """The target's hidden states at the fill positions into ``self.hidden``, row r's at r * w + j."""
        w, n = self.width, len(fills)
        if [f.start for f in fills] == list(range(0, n * w, w)) and hidden.shape[0] >= n * w:
            self.hidden[: n * w].copy_(hidden[: n * w])  # rows of w tokens (a verification graph's): as laid out
            return
        src = [f.start + j for f, c in zip(fills, counts) for j in range(c)]
        dst = [r * w + j for r, c in enumerate(counts) for j in range(c)]
        self.hidden[as_index(dst, hidden.device)] = hidden[as_index(src, hidden.device)]

    def _forward(self, size: int, bound: int) -> torch.Tensor:
        """The captured drafting of ``size`` rows: drafts [k, size] (module docstring)."""
        decode, model, w = self.decode, self.model, self.width
        cols = decode.rows[:, : size * w]
        with set_forward_context(ForwardContext(decode.metadata(size, bound, w), decode.caches)):
            hidden = model.mtp_forward(cols[INPUT_IDS], cols[POSITIONS], self.hidden[: size * w], 0)
        valid = (cols[SEQ_LENS].view(size, w) > 0).sum(dim=1)
        last = torch.arange(size, device=decode.device) * w + (valid - 1).clamp(min=0)
        hidden, positions, live = hidden[last], cols[POSITIONS][last], valid > 0
        drafts = [model.mtp_logits(hidden, 0).argmax(dim=-1)]
        for depth in range(1, self.k):
            positions = positions + 1
            meta = self._chain_metadata(size, bound, positions, live)
            with set_forward_context(ForwardContext(meta, decode.caches)):
                hidden = model.mtp_forward(drafts[-1], positions, hidden, depth)
            drafts.append(model.mtp_logits(hidden, depth).argmax(dim=-1))
        return torch.stack(drafts)

    def _chain_metadata(self, size: int, bound: int, positions: torch.Tensor,
                        live: torch.Tensor) -> AttentionMetadata:  # fmt: skip
        """One token a row at ``positions`` (device), its slot from the row's block table; rows not ``live``
        (padding) write nowhere (slot -1) and attend to nothing (seq_len 0)."""
        decode, block_size = self.decode, self.decode.block_size
        tables = decode.tables[:size]
        blocks = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        meta = AttentionMetadata(
            query_start_loc=list(range(size + 1)),
            context_lens=[bound - 1] * size,  # host values: the captured shape (DecodeGraphs.metadata)
            seq_lens=[bound] * size,
            block_tables=tables,
            slot_mapping=torch.where(live, blocks * block_size + positions % block_size, -1),
            state_slots=decode.rows[STATE_SLOTS, :size],
            block_size=block_size,
        )
        meta.token_seq_lens = torch.where(live, positions + 1, 0).to(torch.int32)
        meta.token_seq_ids = torch.arange(size, device=decode.device)
        return meta

    def _launch(self, size: int, bound: int) -> torch.Tensor:
        graph, drafts = self.graphs[size, bound]
        graph.replay()
        return drafts


def capture_mtp_graphs(model: torch.nn.Module, decode_graphs: DecodeGraphs | None, k: int) -> MTPGraphs | None:
    """MTP drafting's graphs, or None where it runs eagerly (no verification graphs of k drafts, or a capture
    that failed: logged)."""
    if decode_graphs is None or decode_graphs.num_drafts != k or not decode_graphs.verify_sizes:
        return None
    graphs = MTPGraphs(model, decode_graphs, k)
    try:
        graphs.capture()
    except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager drafting
        logger.warning("CUDA graph capture of MTP drafting failed (%s: %s); drafting runs eagerly",
                       type(e).__name__, e)
        return None
    logger.info("captured CUDA graphs of MTP drafting (%d drafts a row) for batch sizes %s", k,
                ", ".join(map(str, graphs.sizes)))
    return graphs
