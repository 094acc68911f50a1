"""Drafters: what proposes a round's draft tree.

`EagleDrafter` runs the EAGLE head over its own KV pool (same slots as the target's): it
catches up on every token the target verified (`catch_up`) and drafts `num_steps` steps of
`topk` branches (`draft`). Test doubles implement the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from plugserve.attention.base import AttentionBackend
from plugserve.pools.kv_pool import KVPool
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.structs.holey_layout import HoleyLayout
from plugserve_spec_eagle.lanes import copy_prefix_tail, lane_kv_lists, layout_step, reorder_lanes
from plugserve_spec_eagle.state import EagleReqState
from plugserve_spec_eagle.tree import DraftCandidates, DraftTree, chain_tree, select_tree


@dataclass
class CatchUp:
    """New verified tokens per request, flattened: the draft writes its KV for them.

    At position p the draft is fed the token at p + 1 and the target's hidden state at p.
    """

    rows: torch.Tensor  # [batch] req_to_token rows
    prefix_lens: list[int]  # positions already caught up
    extend_lens: list[int]  # new positions per request
    input_ids: torch.Tensor  # [tokens] the token following each new position
    positions: torch.Tensor  # [tokens]
    out_cache_loc: torch.Tensor  # [tokens]
    hidden: torch.Tensor  # [tokens, hidden] target hidden states
    seed: list[EagleReqState | None]  # per request: the state whose seed to refresh


class Drafter(Protocol):
    @property
    def kv_pools(self) -> list[KVPool]: ...

    def catch_up(self, batch: CatchUp) -> None: ...

    def draft(
        self, row_ids: torch.Tensor, rows: list[torch.Tensor], states: list[EagleReqState]
    ) -> DraftTree: ...


class EagleDrafter:
    def __init__(
        self,
        head: Any,
        pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        backend: AttentionBackend,
        layout: HoleyLayout,
        num_draft_tokens: int,
        device: torch.device,
        *,
        copy_tail: bool = True,
    ) -> None:
        self.head = head
        # False only under fix toggle prefix_tail_duplicate (the old, wrong behaviour).
        self.copy_tail = copy_tail
        self.pool = pool
        self.req_to_token_pool = req_to_token_pool
        self.backend = backend
        self.layout = layout
        self.num_draft_tokens = num_draft_tokens
        self.device = device

    @property
    def kv_pools(self) -> list[KVPool]:
        return [self.pool]

    # --- catching up ------------------------------------------------------------------------
    def catch_up(self, batch: CatchUp) -> None:
        ends = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
        seeded = [i for i, s in enumerate(batch.seed) if s is not None]
        fb = ForwardBatch.from_lengths(
            ForwardMode.DRAFT_EXTEND,
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            req_pool_indices=batch.rows,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            req_to_token=self.req_to_token_pool.req_to_token,
            kv_pool=self.pool,
            device=self.device,
            logits_indices=ends[seeded].to(self.device),
        )
        self.backend.init_forward_metadata(fb)
        out = self.head(fb, self.backend, batch.hidden)
        if not seeded:
            return
        logp = torch.log_softmax(out.logits.float(), dim=-1)
        top = torch.topk(logp, self.layout.topk, dim=-1)
        ids = self.head.to_target_ids(top.indices)
        for k, i in enumerate(seeded):
            state = batch.seed[i]
            assert state is not None
            state.seed_ids = ids[k]
            state.seed_logprobs = top.values[k]
            state.seed_hidden = out.hidden[k]

    # --- drafting ---------------------------------------------------------------------------
    def draft(
        self, row_ids: torch.Tensor, rows: list[torch.Tensor], states: list[EagleReqState]
    ) -> DraftTree:
        """`row_ids[b]` is request b's req_to_token row and `rows[b]` that row's slots."""
        layout = self.layout
        k = layout.topk
        batch = len(states)
        lens = [s.verified_len for s in states]
        roots = torch.tensor([s.last_token for s in states], dtype=torch.int64)
        if k > 1 and self.copy_tail:
            for row, length in zip(rows, lens, strict=True):
                copy_prefix_tail(self.pool, row, layout, length)
        leaf_ids = torch.stack([s.seed_ids for s in states]).cpu()  # type: ignore[misc]
        leaf_scores = torch.stack([s.seed_logprobs for s in states]).float().cpu()  # type: ignore[misc]
        leaf_hidden = torch.stack([s.seed_hidden for s in states])  # type: ignore[misc]
        leaf_hidden = leaf_hidden[:, None, :].expand(batch, k, -1)
        cand_tokens = [leaf_ids]
        cand_scores = [leaf_scores]
        cand_parents = [torch.full((batch, k), -1, dtype=torch.int64)]
        leaf_cand = torch.arange(k).expand(batch, -1)  # candidate id of each lane's leaf
        next_cand = k
        for forward in range(1, layout.num_steps):
            step = layout_step(forward)  # the core layout's 0-based draft step
            logits, hidden = self._step(row_ids, rows, lens, step, leaf_ids, leaf_hidden)
            logp = torch.log_softmax(logits.float(), dim=-1).view(batch, k, -1)
            top = torch.topk(logp, k, dim=-1)
            child_ids = self.head.to_target_ids(top.indices).cpu()  # [batch, k, k]
            child_scores = leaf_scores[:, :, None] + top.values.cpu()
            cand_tokens.append(child_ids.reshape(batch, k * k))
            cand_scores.append(child_scores.reshape(batch, k * k))
            cand_parents.append(leaf_cand[:, :, None].expand(batch, k, k).reshape(batch, k * k))
            best = torch.topk(child_scores.reshape(batch, k * k), k, dim=-1)
            parent_lane = best.indices // k
            leaf_ids = child_ids.reshape(batch, k * k).gather(1, best.indices)
            leaf_scores = best.values
            leaf_cand = best.indices + next_cand
            next_cand += k * k
            hidden = hidden.view(batch, k, -1)
            leaf_hidden = hidden.gather(
                1, parent_lane.to(hidden.device)[:, :, None].expand(-1, -1, hidden.shape[-1])
            )
            if k > 1:
                for b in range(batch):
                    reorder_lanes(self.pool, rows[b], layout, lens[b], steps_done=step + 1,
                                  parent_lane=parent_lane[b].tolist())
        if k == 1:
            return chain_tree(roots, torch.cat(cand_tokens, dim=1))
        cand = DraftCandidates(torch.cat(cand_tokens, dim=1), torch.cat(cand_scores, dim=1),
                               torch.cat(cand_parents, dim=1))
        return select_tree(roots, cand, self.num_draft_tokens)

    def _step(
        self,
        row_ids: torch.Tensor,
        rows: list[torch.Tensor],
        lens: list[int],
        step: int,
        leaf_ids: torch.Tensor,
        leaf_hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward writing draft step `step` (0-based): every lane's leaf, at token
        position L + step."""
        layout = self.layout
        k = layout.topk
        positions = [length + step for length in lens for _ in range(k)]
        out_loc = torch.cat([
            row[torch.tensor(layout.step_positions(length, step), device=row.device)]
            for row, length in zip(rows, lens, strict=True)
        ])
        fb = ForwardBatch.from_lengths(
            ForwardMode.DRAFT_DECODE,
            input_ids=leaf_ids.reshape(-1),
            positions=positions,
            out_cache_loc=out_loc,
            req_pool_indices=row_ids.repeat_interleave(k),
            prefix_lens=[length + step for length in lens for _ in range(k)],
            extend_lens=[1] * (len(lens) * k),
            req_to_token=self.req_to_token_pool.req_to_token,
            kv_pool=self.pool,
            device=self.device,
        )
        if k > 1:
            lane_kv_lists(rows, lens, layout, step).store(fb)
        self.backend.init_forward_metadata(fb)
        out = self.head(fb, self.backend, leaf_hidden.reshape(-1, leaf_hidden.shape[-1]))
        return out.logits, out.hidden
