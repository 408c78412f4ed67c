"""MTP drafting: the checkpoint's multi-token-prediction layers propose k tokens.

The MTP layer keeps its own latent KV (an MLA layer past the decoder layers,
sharing the request's block table). Each step:

1. Fill: run the MTP layer over every position this step made valid, with the
   *next* token at each position (position j sees token j+1 and the target's
   hidden state at j). For a verified request only ``t, d1 .. da`` are valid;
   rejected positions are left alone and overwritten later.
2. Draft: the last valid position's MTP output gives draft 1; chaining feeds
   each draft and the MTP output back in at the next position (positions past
   the valid ones; the scheduler reserves k lookahead slots for them).

On a GPU with decode graphs, a step whose rows all decoded or verified runs
both parts as one CUDA graph (mtp_graphs.py), replayed right behind the
verification's where every row verifies on the device (greedy rows by the
argmax, the others by spec_decode.verify_rows); other steps run them eagerly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from atom.forward_context import ForwardContext, build_attention_metadata, set_forward_context, upload
from atom.worker.drafters import DraftContext, Drafter


class Fill(NamedTuple):
    """One row's fill: its valid positions context .. context + len(ids) - 1, each with the token after it."""

    row: object  # ScheduledRequest
    start: int  # the row's first token in the step's flat batch (its hidden state's row)
    context: int
    ids: list[int]


class MTPDrafter(Drafter):
    def __init__(self, config, model) -> None:
        if not getattr(model, "num_mtp_layers", 0):
            raise ValueError(
                f"speculative method 'mtp' needs MTP weights, but {config.model!r} declares no "
                "num_nextn_predict_layers; use {'method': 'ngram'} or a checkpoint with MTP layers"
            )
        self.model = model
        self.k = config.num_speculative_tokens
        self.graphs = None  # MTPGraphs, where the runner has decode graphs

    def capture_graphs(self, decode_graphs) -> None:
        """Capture the drafting of steps that run on ``decode_graphs`` (None: drafting stays eager)."""
        from atom.worker.drafters.mtp_graphs import capture_mtp_graphs

        self.graphs = capture_mtp_graphs(self.model, decode_graphs, self.k)

    def draft_after_verification(self, rows, targets=None) -> torch.Tensor | None:
        return None if self.graphs is None else self.graphs.draft_after_verification(rows, targets)

    @property
    def drafts_behind_graphs(self) -> bool:
        return self.graphs is not None

    def drafts_behind(self, rows) -> bool:
        return self.graphs is not None and self.graphs.drafts_behind(rows)

    def propose(self, ctx: DraftContext) -> dict[str, list[int]]:
        fills = [self._fill_row(ctx, i, s) for i, s in enumerate(ctx.rows)]
        if self.graphs is not None and self.graphs.covers(ctx, fills):
            return self.graphs.propose(ctx, fills)
        hidden = self._run(ctx, [f.context for f in fills], fills, [f.ids for f in fills],
                           [ctx.hidden_states[f.start : f.start + len(f.ids)] for f in fills], depth=0)  # fmt: skip
        # the rows that produced tokens continue into drafting, from their last valid position
        ends, drafting = [], []
        for f in fills:
            ends.append((ends[-1] if ends else 0) + len(f.ids))
            if f.row.request_id in ctx.emitted:
                drafting.append((f, ends[-1] - 1))
        drafts: dict[str, list[int]] = {f.row.request_id: [] for f, _ in drafting}
        if not drafting:
            return drafts
        last = hidden[upload([end for _, end in drafting], torch.long, hidden.device)]
        tokens = self.model.mtp_logits(last, 0).argmax(dim=-1)
        for depth in range(1, self.k + 1):
            for (f, _), t in zip(drafting, tokens.tolist()):
                drafts[f.row.request_id].append(t)
            if depth == self.k:
                break
            contexts = [f.context + len(f.ids) + depth - 1 for f, _ in drafting]
            last = self._run(ctx, contexts, [f for f, _ in drafting], [[t] for t in tokens.tolist()], [last], depth)
            tokens = self.model.mtp_logits(last, depth).argmax(dim=-1)
        return drafts

    @staticmethod
    def _fill_row(ctx: DraftContext, i: int, s) -> Fill:
        """This row's valid positions, each with the token that follows it."""
        rid = s.request_id
        if s.draft_token_ids and rid in ctx.emitted:
            valid = len(s.token_ids) - len(s.draft_token_ids) + len(ctx.emitted[rid]) - 1
        else:
            valid = len(s.token_ids)
        following = ctx.token_history.span(rid, s.context_len + 1, s.context_len + valid + 1)
        return Fill(s, ctx.query_start_loc[i], s.context_len, following)

    def _run(self, ctx: DraftContext, contexts: list[int], fills: list[Fill], ids: list[list[int]],
             hidden: list[torch.Tensor], depth: int) -> torch.Tensor:  # fmt: skip
        device = ctx.hidden_states.device
        meta = build_attention_metadata(
            query_lens=[len(x) for x in ids],
            context_lens=contexts,
            block_tables=[f.row.block_ids for f in fills],
            state_slots=[-1] * len(fills),
            block_size=ctx.block_size,
            device=device,
        )
        with set_forward_context(ForwardContext(meta, ctx.caches)):
            return self.model.mtp_forward(
                upload([t for x in ids for t in x], torch.long, device),
                meta.positions,
                torch.cat(hidden, dim=0),
                depth,
            )
