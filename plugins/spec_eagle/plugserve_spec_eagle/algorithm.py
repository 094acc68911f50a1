"""The `eagle` speculative algorithm: draft, verify with a tree mask, accept, catch up.

One round for a request with verified length L and last verified token t (its KV not yet
written):
1. the drafter proposes a tree rooted at t (chain for topk 1);
2. one target forward verifies every node at once (TARGET_VERIFY, tree mask): node i at
   position L + depth(i), written at row position L + i;
3. acceptance keeps the longest matching path and a bonus token;
4. the accepted nodes' target KV moves to row positions L + 1 .. L + accepted (a chain needs
   no move), so the committed KV is contiguous;
5. the drafter catches up on the accepted tokens, which seeds the next round.
The core owns the slots (see plugserve.mem.spec_accounting) and reserves what
`plan_footprint` asks for; nothing here allocates.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from plugserve.config import EngineConfig
from plugserve.grammar.constraint import token_constraint
from plugserve.pools.kv_pool import KVPool
from plugserve.spec.base import SpecAlgorithm, SpecContext, SpecDecodeOutput
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.structs.spec_footprint import SpecFootprint
from plugserve.structs.step import PreparedStep
from plugserve_spec_eagle.accept import accept_all
from plugserve_spec_eagle.drafter import CatchUp, Drafter, EagleDrafter
from plugserve_spec_eagle.footprint import eagle_footprint
from plugserve_spec_eagle.lanes import LaneLayout
from plugserve_spec_eagle.state import EagleReqState
from plugserve_spec_eagle.tree import DraftTree
from plugserve_spec_eagle.weights import default_head_dir

PREFIX_TAIL_DUPLICATE = "prefix_tail_duplicate"  # fix toggle, registered in plugin.FIX_TOGGLES


class EagleAlgorithm(SpecAlgorithm):
    def __init__(self, ctx: SpecContext, drafter: Drafter | None = None) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.layout = LaneLayout(cfg.page_size, cfg.spec_steps, cfg.spec_topk)
        self.num_draft_tokens = cfg.num_draft_tokens
        self.drafter: Drafter = drafter if drafter is not None else self._load_drafter()
        # A tensor-parallel target's rank: rank 0's drafts and acceptances are every rank's.
        self.shard = getattr(ctx.target, "shard", None)

    def _load_drafter(self) -> EagleDrafter:
        from plugserve_spec_eagle.head import load_head

        ctx = self.ctx
        path = self.config.draft_model or default_head_dir()
        head = load_head(path, ctx.target, dtype=ctx.dtype, device=ctx.device,
                         quantization=self.config.quantization,
                         quant_activations=self.config.quant_activations)
        hc = head.config
        pool = KVPool(
            num_pages=ctx.num_pages, page_size=self.config.page_size, layer_ids=[0],
            num_kv_heads=hc.num_key_value_heads, head_dim=hc.head_dim, dtype=ctx.dtype,
            device=ctx.device, name="draft",
        )
        return EagleDrafter(head, pool, ctx.req_to_token_pool, ctx.backend, self.layout,
                            self.num_draft_tokens, ctx.device,
                            copy_tail=PREFIX_TAIL_DUPLICATE not in self.config.revert_fixes)

    @classmethod
    def plan_footprint(cls, config: EngineConfig) -> SpecFootprint:
        return eagle_footprint(config)

    @classmethod
    def build_test_draft(cls, target_dir: Path, out_dir: Path) -> Path | None:
        """A tiny EAGLE head trained on the tiny target's greedy output (seconds)."""
        from plugserve_spec_eagle.testing import make_tiny_head_dir

        return make_tiny_head_dir(target_dir, out_dir, trained=True)

    @property
    def kv_pools(self) -> list[KVPool]:
        return list(self.drafter.kv_pools)

    def _time(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.ctx.time_s[name] = self.ctx.time_s.get(name, 0.0) + now - since
        return now

    # --- after a target prefill chunk -------------------------------------------------------
    def after_extend(self, step: PreparedStep, output: Any, next_token_ids: list[int]) -> None:
        fb = step.forward_batch
        follow = torch.tensor(fb.extra["next_token_ids"], dtype=torch.int64)
        seeds: list[EagleReqState | None] = []
        ends = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        for i, req in enumerate(step.reqs):
            if not step.sample_mask[i]:
                seeds.append(None)
                continue
            token = next_token_ids[i]
            follow[ends[i]] = token
            seq_len = fb.seq_lens_cpu[i]
            history = fb.extra["seq_token_ids"][i]
            state = EagleReqState(verified_len=seq_len, last_token=token,
                                  token_ids=[*history, token])
            req.spec_state = state
            seeds.append(state)
        assert output.token_hidden_states is not None, "the runner captures hidden states"
        self.drafter.catch_up(CatchUp(
            rows=fb.req_pool_indices, prefix_lens=list(fb.extend_prefix_lens_cpu),
            extend_lens=list(fb.extend_seq_lens_cpu), input_ids=follow,
            positions=fb.positions, out_cache_loc=fb.out_cache_loc,
            hidden=output.token_hidden_states, seed=seeds,
        ))

    # --- one round --------------------------------------------------------------------------
    def decode(self, step: PreparedStep) -> SpecDecodeOutput:
        t0 = time.perf_counter()
        table = self.ctx.req_to_token_pool.req_to_token
        # The rows as the batch was prepared: under the overlap loop the scheduler may have
        # released a request (`req.req_pool_idx` None) while this round was in flight.
        row_ids = step.forward_batch.req_pool_indices.cpu()
        states: list[EagleReqState] = [r.spec_state for r in step.reqs]
        rows = [table[int(i)] for i in row_ids]
        tree = self.drafter.draft(row_ids, rows, states)
        if self.shard is not None:  # the verify's input must be one tree on every rank
            tree = self.shard.broadcast_object(tree)
        t1 = self._time("draft", t0)
        logits, hidden = self._verify(row_ids, rows, states, tree)
        t2 = self._time("verify", t1)
        constraints = [
            token_constraint(self.ctx.grammar, r, s.token_ids[len(r.origin_input_ids):])
            for r, s in zip(step.reqs, states, strict=True)]
        accepted = accept_all(tree, logits.view(len(states), tree.num_nodes, -1),
                              [r.sampling for r in step.reqs],
                              [r.generator for r in step.reqs], constraints)
        if self.shard is not None:  # what every rank keeps and emits: rank 0's choice
            accepted = self.shard.broadcast_object(accepted)
        self._move_accepted_kv(rows, states, [a.path for a in accepted])
        t3 = self._time("accept", t2)
        self._catch_up_after_verify(row_ids, rows, states, tree, hidden,
                                    [a.path for a in accepted], [a.tokens for a in accepted])
        self._time("draft_extend", t3)
        want_lp = any(r.sampling.logprobs for r in step.reqs)
        return SpecDecodeOutput(
            tokens=[a.tokens for a in accepted],
            logprobs=[a.logprobs for a in accepted] if want_lp else None,
        )

    def _verify(
        self, row_ids: torch.Tensor, rows: list[torch.Tensor], states: list[EagleReqState],
        tree: DraftTree,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = self.ctx
        n = tree.num_nodes
        lens = [s.verified_len for s in states]
        anc = tree.ancestor_mask()
        masks = []
        out_loc = []
        for b, length in enumerate(lens):
            masks.append(torch.cat([torch.ones(n, length, dtype=torch.bool), anc[b]], dim=1)
                         .reshape(-1))
            out_loc.append(rows[b][length : length + n])
        positions = (torch.tensor(lens, dtype=torch.int64)[:, None] + tree.depths).reshape(-1)
        fb = ForwardBatch.from_lengths(
            ForwardMode.TARGET_VERIFY,
            input_ids=tree.tokens.reshape(-1),
            positions=positions,
            out_cache_loc=torch.cat(out_loc),
            req_pool_indices=row_ids,
            prefix_lens=lens,
            extend_lens=[n] * len(lens),
            req_to_token=ctx.req_to_token_pool.req_to_token,
            kv_pool=ctx.target_kv_pool,
            device=ctx.device,
            custom_mask=torch.cat(masks).to(ctx.device),
            capture_hidden=True,
        )
        ctx.backend.init_forward_metadata(fb)
        out = ctx.target(fb, ctx.backend)
        assert out.token_hidden_states is not None
        return out.logits, out.token_hidden_states

    def _move_accepted_kv(
        self, rows: list[torch.Tensor], states: list[EagleReqState], paths: list[list[int]]
    ) -> None:
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        for row, state, path in zip(rows, states, paths, strict=True):
            length = state.verified_len
            moved = [(d, node) for d, node in enumerate(path) if node != d]
            if moved:
                dst.append(row[[length + d for d, _ in moved]])
                src.append(row[[length + node for _, node in moved]])
        if dst:
            self.ctx.target_kv_pool.copy_slots(torch.cat(dst), torch.cat(src))

    def _catch_up_after_verify(
        self, row_ids: torch.Tensor, rows: list[torch.Tensor], states: list[EagleReqState],
        tree: DraftTree, hidden: torch.Tensor, paths: list[list[int]], emitted: list[list[int]],
    ) -> None:
        n = tree.num_nodes
        ids: list[int] = []
        positions: list[int] = []
        locs: list[torch.Tensor] = []
        hidden_rows: list[int] = []
        for b, (state, path, tokens) in enumerate(zip(states, paths, emitted, strict=True)):
            length = state.verified_len
            ids.extend(tokens)
            positions.extend(range(length, length + len(tokens)))
            locs.append(rows[b][length : length + len(tokens)])
            hidden_rows.extend(b * n + node for node in path)
        prefix = [s.verified_len for s in states]
        ext = [len(t) for t in emitted]
        self.drafter.catch_up(CatchUp(
            rows=row_ids, prefix_lens=prefix, extend_lens=ext,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_cache_loc=torch.cat(locs),
            hidden=hidden[torch.tensor(hidden_rows, device=hidden.device)],
            seed=list(states),
        ))
        for state, tokens in zip(states, emitted, strict=True):
            state.verified_len += len(tokens)
            state.last_token = tokens[-1]
            state.token_ids.extend(tokens)
