"""The host-side shortcuts of a decode step give what the general paths give:

- req_to_token reads and writes through its numpy view land in the tensor itself;
- a ForwardBatch built from host lists (one tensor, viewed in parts) holds the lists' values;
- sampled tokens go into the future-token buffer only under the overlap loop, and both loops
  give the same tokens (the invariant checker at level 1).

torch_native's decode metadata without padding (batch 1: no mask built) is covered by the
token-identity tests against transformers (tests/core/test_greedy_vs_hf.py) and the
conformance kit's decode scenarios.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.sampling import SamplingParams
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts


def test_req_to_token_host_view_is_the_tensor() -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    pool.write(1, 2, [7, 8, 9])
    pool.write(2, 0, torch.tensor([4, 5]))
    assert pool.req_to_token[1].tolist() == [0, 0, 7, 8, 9, 0, 0, 0]
    assert pool.req_to_token[2, :2].tolist() == [4, 5]
    assert [pool.slot(1, 3), pool.slot(2, 1)] == [8, 5]
    pool.req_to_token[0, 5] = 11  # a torch write is seen by the host view
    assert pool.slot(0, 5) == 11
    with pytest.raises(RuntimeError, match="8 slots wide"):
        pool.write(0, 6, [1, 2, 3])


def test_forward_batch_from_host_lists() -> None:
    table = torch.zeros(2, 16, dtype=torch.int64)
    fb = ForwardBatch.from_lengths(
        ForwardMode.EXTEND, input_ids=[3, 4, 5, 6], positions=[0, 1, 2, 7],
        out_cache_loc=[9, 10, 11, 12], req_pool_indices=torch.tensor([0, 1]),
        prefix_lens=[0, 7], extend_lens=[3, 1], req_to_token=table, kv_pool=None,  # type: ignore[arg-type]
        device="cpu",
    )
    got = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.seq_lens, fb.extend_prefix_lens,
           fb.extend_seq_lens]
    assert [t.tolist() for t in got] == [[3, 4, 5, 6], [0, 1, 2, 7], [9, 10, 11, 12], [3, 8],
                                         [0, 7], [3, 1]]
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in got)
    assert fb.seq_lens_cpu == [3, 8] and fb.num_tokens == 4


PROMPTS = random_prompts(3, 200, 5, 40, seed=3)


class TestFutureTokens(EngineTest):
    def _run(self, **config: Any) -> tuple[list[list[int]], torch.Tensor]:
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 4, 12)]
        with self.engine(dtype="float32", **config) as engine:
            tokens = [r.token_ids for r in engine.generate(PROMPTS, params)]
            tokens.append(engine.generate(PROMPTS[:1], params[:1])[0].token_ids)
            self.assert_idle_memory_whole(engine)
            return tokens, engine.runner.future_tokens.clone()

    def test_future_tokens_written_only_under_overlap(self) -> None:
        plain, plain_futures = self._run()
        overlapped, futures = self._run(overlap=True)
        assert plain == overlapped
        assert not plain_futures.any()  # nothing reads it without the overlap loop
        assert futures.any()
