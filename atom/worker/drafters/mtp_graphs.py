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

Between a verification step and that drafting the GPU idles while the host
accepts the drafts and fills the buffers. The verification itself runs on the
device (greedy rows by the graph's argmax, the others by
``spec_decode.verify_rows``), so a second graph per size and bound drafts
straight from the verification graph's outputs, replayed right behind it when
every row of the step has drafts or verifies greedily. Its accepted counts
come from comparing the drafts in the input ids with the argmax (the longest
run of matches, within each row's own drafts), and since an accepted draft
equals the argmax at its position, the fill's tokens (each position's next
token) are the argmax at those positions::

    verification row r:  ids     t   d1  d2  d3      (columns r*w .. r*w + 3)
                         argmax  a0  a1  a2  a3      d1 == a0, d2 == a1, d3 != a2: 2 accepted
    its fill:            ids     a0  a1  a2  -       positions, slots, hidden states: the verification's;
                                                     the columns past 1 + accepted write nowhere (slot -1)

A row that samples (or has penalties or logprobs) first has its targets
written over its argmax: its accepted drafts, then the token it emits in
every later column (``Verdict.targets``). They read as an argmax would: the
run of matches stops at the emitted token, which differs from the rejected
draft. The runner copies the step's tokens and the drafts to the host
together (one copy), and the host's acceptance gives the same counts.
"""

from __future__ import annotations

import logging

import torch

from atom.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from atom.ops.cuda.fused import INPUT_IDS, POSITIONS, SEQ_LENS, SLOT_MAPPING, leading_matches
from atom.worker.cuda_graph import DecodeGraphs, DecodeOutput, as_index, capture_graph, fill_decode_buffers

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
        # (size, bound, after verification): drafts [k, size] (module docstring)
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Two graphs per (size, bound), most rows first, in the decode graphs' memory pool: drafting from the
        static buffers, and drafting from the outputs of the verification graph of that size and bound."""
        for bound in reversed(self.decode.bounds):
            for size in reversed(self.sizes):
                for after in (False, True):
                    source = self._verification(size, bound) if after else None
                    self.graphs[size, bound, after] = capture_graph(lambda: self._forward(size, bound, source),
                                                                    self.decode.pool)  # fmt: skip
        torch.cuda.synchronize(self.decode.device)

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

    def draft_after_verification(self, rows, targets=None) -> torch.Tensor | None:
        """Right behind a verification step on the graphs: the rows' drafts [k, n] on the device (not yet copied).
        ``targets`` (row indices, their targets [m, <= w]): written over those rows' argmax first. None where
        the chained drafts could pass that graph's bound."""
        if not self.drafts_behind(rows):
            return None
        size = next(s for s in self.sizes if s >= len(rows))  # the verification graph's (the same sizes)
        bound = self.decode.bound(max(s.context_len + len(s.token_ids) for s in rows))
        if targets is not None:
            index, values = targets
            self._verification(size, bound).greedy.view(size, self.width)[index, : values.shape[1]] = values
        return self._launch(size, bound, after=True)[:, : len(rows)]

    def drafts_behind(self, rows) -> bool:
        """Whether the chained drafts stay within the bound of the verification graph of these rows."""
        longest = max(s.context_len + len(s.token_ids) for s in rows)
        return longest + self.k - 1 <= self.decode.bound(longest)

    def _verification(self, size: int, bound: int) -> DecodeOutput:
        """The outputs (static buffers) of the verification graph of this size and bound."""
        return self.decode.graphs[size, bound, self.width][1]

    def _forward(self, size: int, bound: int, verification: DecodeOutput | None = None) -> torch.Tensor:
        """The captured drafting of ``size`` rows: drafts [k, size]. From the static buffers (``self.hidden``,
        the rows buffer as ``propose`` fills it) or from ``verification``'s outputs (module docstring)."""
        decode, w = self.decode, self.width
        cols = decode.rows[:, : size * w]
        meta = decode.metadata(size, bound, w)
        if verification is None:
            ids, hidden = cols[INPUT_IDS], self.hidden[: size * w]
            valid = (cols[SEQ_LENS].view(size, w) > 0).sum(dim=1)
        else:  # still the verification's buffers
            ids, hidden = verification.greedy, verification.hidden
            argmax, inputs = ids.view(size, w), cols[INPUT_IDS].view(size, w)
            tokens = (cols[SEQ_LENS].view(size, w) > 0).sum(dim=1)  # 1 + the row's drafts; 0 a padding row
            accepted = leading_matches(inputs, argmax, tokens - 1)
            valid = torch.where(tokens > 0, accepted + 1, 0)
            live = (torch.arange(w, device=decode.device) < valid.unsqueeze(1)).flatten()
            meta.slot_mapping = torch.where(live, cols[SLOT_MAPPING], -1)  # (the rest attend, and are dropped)
        return self._draft(size, bound, meta, ids, hidden, valid)

    def _draft(self, size: int, bound: int, meta: AttentionMetadata, ids: torch.Tensor, hidden: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The fill over the rows' columns (``valid`` of each row's), then the chain from each row's last."""
        decode, model, w = self.decode, self.model, self.width
        positions = decode.rows[POSITIONS, : size * w]
        with set_forward_context(ForwardContext(meta, decode.caches)):
            hidden = model.mtp_forward(ids, positions, hidden, 0)
        last = torch.arange(size, device=decode.device) * w + (valid - 1).clamp(min=0)
        hidden, positions, live = hidden[last], positions[last], valid > 0
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
        """A decode step's metadata (one token a row) at ``positions`` (device), each slot from the row's block
        table; rows not ``live`` (padding) write nowhere (slot -1) and attend to nothing (seq_len 0)."""
        block_size = self.decode.block_size
        meta = self.decode.metadata(size, bound)  # its slots and lengths are the fill's: replaced here
        blocks = meta.block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        meta.slot_mapping = torch.where(live, blocks * block_size + positions % block_size, -1)
        meta.token_seq_lens = torch.where(live, positions + 1, 0).to(torch.int32)
        return meta

    def _launch(self, size: int, bound: int, after: bool = False) -> torch.Tensor:
        graph, drafts = self.graphs[size, bound, after]
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
