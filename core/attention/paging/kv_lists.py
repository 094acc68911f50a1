"""Per-query KV lists of a decode (the topk>1 draft decode's branches): the three keys a spec
plugin stores in `forward_batch.extra`, and `DraftKVLists`, which reads and checks them. The
contract is documented in `plugserve.attention.draft_kv`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugserve.attention.paging.pages import indptr_from_lengths
from plugserve.structs.forward_batch import ForwardBatch

DRAFT_KV_INDPTR = "draft_kv_indptr"
DRAFT_KV_INDICES = "draft_kv_indices"
DRAFT_KV_LENS_CPU = "draft_kv_lens_cpu"
DRAFT_KV_KEYS = (DRAFT_KV_INDPTR, DRAFT_KV_INDICES, DRAFT_KV_LENS_CPU)


@dataclass
class DraftKVLists:
    """The per-query KV lists of one draft-decode step (contract: `plugserve.attention.draft_kv`)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens_cpu: list[int]

    @property
    def num_queries(self) -> int:
        return len(self.kv_lens_cpu)

    def kv_indptr_cpu(self) -> list[int]:
        return indptr_from_lengths(self.kv_lens_cpu)

    def store(self, fb: ForwardBatch) -> None:
        fb.extra[DRAFT_KV_INDPTR] = self.kv_indptr
        fb.extra[DRAFT_KV_INDICES] = self.kv_indices
        fb.extra[DRAFT_KV_LENS_CPU] = list(self.kv_lens_cpu)

    @classmethod
    def from_batch(cls, fb: ForwardBatch) -> DraftKVLists | None:
        """The lists a spec plugin stored in `fb.extra`, or None when it stored none."""
        present = [key for key in DRAFT_KV_KEYS if key in fb.extra]
        if not present:
            return None
        if len(present) != len(DRAFT_KV_KEYS):
            missing = [key for key in DRAFT_KV_KEYS if key not in fb.extra]
            raise ValueError(
                f"forward_batch.extra has {present} but lacks {missing}: a draft decode with "
                "per-branch KV lists needs all of " + ", ".join(DRAFT_KV_KEYS)
            )
        lists = cls(fb.extra[DRAFT_KV_INDPTR], fb.extra[DRAFT_KV_INDICES],
                    list(fb.extra[DRAFT_KV_LENS_CPU]))
        if lists.num_queries != fb.num_tokens:
            raise ValueError(
                f"draft decode has {fb.num_tokens} queries but {lists.num_queries} KV lists in "
                f"forward_batch.extra[{DRAFT_KV_LENS_CPU!r}]; give one list per branch, "
                "request-major"
            )
        return lists
