"""Bad requests are rejected one by one, with a message that says what was wrong; the other
requests of the same call are served and returned, and nothing stays queued."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.engine import Engine, EngineStoppedError
from plugserve.request_input import PromptError, token_ids
from plugserve.sampling import MIN_TEMPERATURE, SamplingParams
from plugserve.testing import EngineTest

VOCAB = 100


def _any(value: object) -> Any:
    """A value of the wrong type, passed where the API's annotations forbid it."""
    return value


NAN, INF = float("nan"), float("inf")


# --- SamplingParams.problems ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("temperature", "shown"),
    [(NAN, "nan"), (INF, "inf"), (-INF, "-inf"), (1e-45, "1e-45"), (1e-6, "1e-06"), (-1.0, "-1.0")],
)
def test_bad_temperature_is_rejected(temperature: float, shown: str) -> None:
    problems = SamplingParams(temperature=temperature).problems(VOCAB)
    assert problems == [
        f"temperature must be 0 (greedy) or a finite number >= 1e-05, got {shown}"
        + (
            "; positive values below 1e-05 are rejected, not treated as greedy: pass 0 for greedy"
            if 0 < temperature < MIN_TEMPERATURE
            else ""
        )
    ]


@pytest.mark.parametrize("temperature", [0, 0.0, -0.0, MIN_TEMPERATURE, 0.7, 1, 5.0, 1e6])
def test_good_temperature_is_accepted(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).problems(VOCAB) == []


def test_tiny_temperature_is_rejected_not_treated_as_greedy() -> None:
    sp = SamplingParams(temperature=1e-6)
    assert not sp.greedy
    assert "pass 0 for greedy" in sp.problems(VOCAB)[0]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("top_p", NAN, "top_p must be a finite number in (0, 1], got nan"),
        ("top_p", INF, "top_p must be a finite number in (0, 1], got inf"),
        ("top_p", 0.0, "top_p must be a finite number in (0, 1], got 0.0"),
        ("min_p", NAN, "min_p must be a finite number in [0, 1], got nan"),
        ("min_p", INF, "min_p must be a finite number in [0, 1], got inf"),
        ("min_p", -0.5, "min_p must be a finite number in [0, 1], got -0.5"),
        ("max_new_tokens", 2.5, "max_new_tokens must be an int, got 2.5 (float)"),
        ("max_new_tokens", 3.0, "max_new_tokens must be an int, got 3.0 (float)"),
        ("max_new_tokens", True, "max_new_tokens must be an int, got True (bool)"),
        ("max_new_tokens", "8", "max_new_tokens must be an int, got '8' (str)"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1, got 0"),
        ("top_k", 2.0, "top_k must be an int (-1 = off), got 2.0 (float)"),
        ("top_k", True, "top_k must be an int (-1 = off), got True (bool)"),
        ("temperature", "0.5", "temperature must be a number (0 for greedy), got '0.5' (str)"),
        ("temperature", None, "temperature must be a number (0 for greedy), got None (NoneType)"),
        ("temperature", True, "temperature must be a number (0 for greedy), got True (bool)"),
        ("top_p", None, "top_p must be a number in (0, 1], got None (NoneType)"),
        ("min_p", "0", "min_p must be a number in [0, 1], got '0' (str)"),
        ("seed", 1.5, "seed must be None or an int, got 1.5 (float)"),
        ("seed", 1 << 64, f"seed must be in [-2**63, 2**64 - 1], got {1 << 64}"),
        ("stop_token_ids", (1.0,), "stop_token_ids must be ints, got 1.0 (float)"),
        ("stop_token_ids", 5, "stop_token_ids must be a tuple of ints, got 5 (int)"),
        ("stop", "end", "stop must be a tuple of strings, got 'end' (str)"),
        ("stop", (1,), "stop strings must be str, got 1 (int)"),
        ("ignore_eos", "no", "ignore_eos must be a bool, got 'no' (str)"),
        ("logprobs", 1, "logprobs must be a bool, got 1 (int)"),
    ],
)
def test_field_problems(field: str, value: Any, message: str) -> None:
    assert SamplingParams(**{field: value}).problems(VOCAB) == [message]


def test_numpy_and_int_numbers_are_fine() -> None:
    np = pytest.importorskip("numpy")
    sp = SamplingParams(
        max_new_tokens=np.int64(4),
        temperature=np.float32(0.5),
        top_k=3,
        top_p=1,
        min_p=0,
        seed=np.int32(7),
        stop_token_ids=(np.int64(2),),
    )
    assert sp.problems(VOCAB) == []


# --- prompt normalisation -------------------------------------------------------------------
def test_token_ids_accepts_int_sequences() -> None:
    assert token_ids([5, 6, 7]) == [5, 6, 7]
    assert token_ids((5, 6)) == [5, 6]
    assert token_ids(torch.tensor([3, 4])) == [3, 4]
    assert token_ids([]) == []  # empty is reported by the engine ("prompt is empty")


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (
            ["a", "b"],
            "prompt token ids must be ints; got position 0: 'a' (str), position 1: 'b' (str)",
        ),
        ([5.0], "prompt token ids must be ints; got position 0: 5.0 (float)"),
        ([1, 6.5], "prompt token ids must be ints; got position 1: 6.5 (float)"),
        ([True, 2], "prompt token ids must be ints; got position 0: True (bool)"),
        ([None], "prompt token ids must be ints; got position 0: None (NoneType)"),
        ([[1, 2]], "prompt token ids must be ints; got position 0: [1, 2] (list)"),
        (5.0, "prompt must be a string or a list of int token ids, got 5.0 (float)"),
        (None, "prompt must be a string or a list of int token ids, got None (NoneType)"),
        (b"ab", "prompt must be a string or a list of int token ids, got b'ab' (bytes)"),
        ({1, 2}, "prompt must be a string or a list of int token ids, got {1, 2} (set)"),
    ],
)
def test_token_ids_rejects_non_integers(prompt: Any, message: str) -> None:
    with pytest.raises(PromptError) as info:
        token_ids(prompt)
    assert str(info.value) == message


def test_bare_int_prompt_gets_a_hint() -> None:
    with pytest.raises(PromptError, match=r"\[\[5, 6, 7\]\], not \[5, 6, 7\]"):
        token_ids(5)


# --- the engine -----------------------------------------------------------------------------
GOOD = [[5, 6, 7], [8, 9, 10, 11]]
BAD_PROMPTS: list[Any] = [
    ["a", "b"],
    5.0,
    6.5,
    [6.5],
    True,
    [True, 3],
    None,
    [None],
    [[1, 2], [3]],
    [5, [6]],
]


class TestRequestValidation(EngineTest):
    def _check_served(self, engine: Engine, good: list[Any], n: int) -> None:
        for r in good:
            assert r.error is None, r.error
            assert r.finish_reason == "length"
            assert len(r.token_ids) == n
        assert engine.scheduler.is_idle()
        self.assert_idle_memory_whole(engine)

    def test_bad_prompts_rejected_good_ones_served(self, tiny_model_dir: Path) -> None:
        prompts: list[Any] = [GOOD[0], *BAD_PROMPTS, GOOD[1]]
        sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir)) as engine:
            out = engine.generate(prompts, sp)
            assert [r.index for r in out] == list(range(len(prompts)))
            self._check_served(engine, [out[0], out[-1]], 3)
            for r, prompt in zip(out[1:-1], BAD_PROMPTS, strict=True):
                assert r.finish_reason == "error", prompt
                assert r.error is not None and "prompt" in r.error, (prompt, r.error)
                assert r.token_ids == [] and r.prompt_tokens == 0
            # Nothing of the first call leaks into the next one.
            again = engine.generate([GOOD[0]], sp)
            assert len(again) == 1 and again[0].token_ids == out[0].token_ids

    def test_bad_sampling_params_rejected_good_ones_served(self, tiny_model_dir: Path) -> None:
        good = SamplingParams(max_new_tokens=2, ignore_eos=True)
        bad = [
            SamplingParams(max_new_tokens=_any(2.5)),
            SamplingParams(temperature=NAN),
            SamplingParams(temperature=1e-45),
            SamplingParams(temperature=INF),
            SamplingParams(temperature=0.5, top_p=NAN),
            SamplingParams(temperature=0.5, min_p=INF),
            SamplingParams(temperature=0.5, seed=_any(1.5)),
            SamplingParams(top_k=_any(2.0)),
        ]
        params = [
            good,
            *bad,
            SamplingParams(max_new_tokens=2, temperature=0.8, seed=3, ignore_eos=True),
        ]
        prompts = [GOOD[0]] * len(params)
        with self.engine(model=str(tiny_model_dir)) as engine:
            out = engine.generate(prompts, params)
            self._check_served(engine, [out[0], out[-1]], 2)
            for r, sp in zip(out[1:-1], bad, strict=True):
                assert r.finish_reason == "error"
                assert r.error == "; ".join(sp.problems(engine.arch.vocab_size))
            assert out[1].error == "max_new_tokens must be an int, got 2.5 (float)"
            assert out[2].error is not None and out[2].error.startswith(
                "temperature must be 0 (greedy) or a finite number >= 1e-05, got nan"
            )

    def test_sampling_of_the_wrong_type_is_a_request_error(self, tiny_model_dir: Path) -> None:
        sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir)) as engine:
            out = engine.generate([GOOD[0], GOOD[1]], [sp, _any({"temperature": 0.5})])
            self._check_served(engine, [out[0]], 2)
            assert out[1].finish_reason == "error"
            assert out[1].error == "sampling must be a SamplingParams, got dict"
            with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
                engine.generate([GOOD[0]], _any(3))
            assert engine.scheduler.is_idle()

    def test_stream_serves_the_good_requests(self, tiny_model_dir: Path) -> None:
        sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir)) as engine:
            events = list(engine.stream([GOOD[0], _any(["x"]), GOOD[1]], sp))
            finals = {e.index: e.result for e in events if e.finished}
            assert sorted(finals) == [0, 1, 2]
            assert finals[1] is not None and finals[1].finish_reason == "error"
            self._check_served(engine, [finals[0], finals[2]], 2)

    def test_a_failing_submit_leaves_nothing_queued(
        self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir)) as engine:
            real_submit = engine.submit
            calls = []

            def flaky_submit(prompt: Any, sampling: Any = None, *, chat: bool = False,
                             **session: Any) -> Any:
                calls.append(prompt)
                if len(calls) == 2:
                    raise EngineStoppedError("stopped")
                return real_submit(prompt, sampling, chat=chat, **session)

            monkeypatch.setattr(engine, "submit", flaky_submit)
            with pytest.raises(EngineStoppedError):
                engine.generate(GOOD, sp)
            assert engine.scheduler.is_idle()  # the first request was taken back
            monkeypatch.setattr(engine, "submit", real_submit)
            out = engine.generate([GOOD[1]], sp)
            self._check_served(engine, out, 2)
