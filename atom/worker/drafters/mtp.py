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
"""

from __future__ import annotations

import torch

from atom.forward_context import ForwardContext, build_attention_metadata, set_forward_context, upload
from atom.worker.drafters import DraftContext


class MTPDrafter:
    def __init__(self, config, model) -> None:
        if not getattr(model, "num_mtp_layers", 0):
            raise ValueError(
                f"speculative method 'mtp' needs MTP weights, but {config.model!r} declares no "
                "num_nextn_predict_layers; use {'method': 'ngram'} or a checkpoint with MTP layers"
            )
        self.model = model
        self.k = config.num_speculative_tokens

    def propose(self, ctx: DraftContext) -> dict[str, list[int]]:
        fill = [self._fill_row(ctx, i, s) for i, s in enumerate(ctx.rows)]
        hidden = self._run(ctx, fill, [f["ids"] for f in fill], [f["hidden"] for f in fill], depth=0)
        # the rows that produced tokens continue into drafting, from their last valid position
        drafting = [(f, hidden[f["offset"] + len(f["ids"]) - 1]) for f in fill if f["row"].request_id in ctx.emitted]
        drafts: dict[str, list[int]] = {f["row"].request_id: [] for f, _ in drafting}
        if not drafting:
            return drafts
        last = torch.stack([h for _, h in drafting])
        tokens = self.model.mtp_logits(last, 0).argmax(dim=-1)
        for depth in range(1, self.k + 1):
            for (f, _), t in zip(drafting, tokens.tolist()):
                drafts[f["row"].request_id].append(t)
            if depth == self.k:
                break
            steps = [dict(f, context=f["context"] + len(f["ids"]) + depth - 1) for f, _ in drafting]
            last = self._run(ctx, steps, [[t] for t in tokens.tolist()], [h.unsqueeze(0) for h in last], depth)
            tokens = self.model.mtp_logits(last, depth).argmax(dim=-1)
        return drafts

    def _fill_row(self, ctx: DraftContext, i: int, s) -> dict:
        """This row's valid positions, each with the token that follows it."""
        start = ctx.query_start_loc[i]
        rid = s.request_id
        if s.draft_token_ids and rid in ctx.emitted:
            valid = len(s.token_ids) - len(s.draft_token_ids) + len(ctx.emitted[rid]) - 1
        else:
            valid = len(s.token_ids)
        history = ctx.token_history[rid]
        following = history[s.context_len + 1 : s.context_len + valid + 1]
        return dict(row=s, context=s.context_len, ids=following, hidden=ctx.hidden_states[start : start + valid])

    def _run(self, ctx: DraftContext, rows: list[dict], ids: list[list[int]], hidden: list, depth: int):
        flat_ids = []
        for r, row_ids in zip(rows, ids):
            r["offset"] = len(flat_ids)
            flat_ids.extend(row_ids)
        device = ctx.hidden_states.device
        meta = build_attention_metadata(
            query_lens=[len(x) for x in ids],
            context_lens=[r["context"] for r in rows],
            block_tables=[r["row"].block_ids for r in rows],
            state_slots=[-1] * len(rows),
            block_size=ctx.block_size,
            device=device,
        )
        with set_forward_context(ForwardContext(meta, ctx.caches)):
            return self.model.mtp_forward(
                upload(flat_ids, torch.long, device),
                meta.positions,
                torch.cat(hidden, dim=0),
                depth,
            )
