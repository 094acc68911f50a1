"""The speculative-algorithm suite: on a tiny target, for every attention backend x page size
x topk x normal/overlap combination the capability table allows, speculative greedy output
equals plain greedy output token for token (lossless), the invariant checker at level 1 with
physical page checks finds nothing, memory is whole at idle, and every round stays inside
the footprint the algorithm declared (`probe.FootprintProbe`). Only the public `Engine` API,
the checker and the algorithm's own contract objects are used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.testing.conformance.declared import gate
from plugserve.testing.conformance.generations import (
    assert_checked_and_whole,
    assert_tokens,
    generate_greedy,
)
from plugserve.testing.conformance.spec.cases import (
    SpecCase,
    default_device,
    refusal,
    spec_cases,
    workload,
)
from plugserve.testing.conformance.spec.models import spec_models
from plugserve.testing.conformance.spec.probe import FootprintProbe
from plugserve.testing.conformance.spec.target import SpecAlgorithmUnderTest, SpecRequirements
from plugserve.testing.conformance.threads import OneCPUThread
from plugserve.testing.engine_test import EngineTest

__all__ = ["TestSpecFootprint", "TestSpecLossless"]

# Plain greedy output per (target folder, backend, page size, device), computed once.
_PLAIN: dict[tuple[str, str, int, str], list[list[int]]] = {}


class SpecConformanceTest(OneCPUThread):
    """Parametrized over `SpecCase`s: the backends are `backends` when a subclass sets it,
    else `--spec-backend NAME` (repeatable), else every registered attention backend. A case
    the algorithm's capabilities or the capability table refuse is skipped with the
    reasons."""

    backends: tuple[str, ...] = ()
    target: SpecAlgorithmUnderTest
    case: SpecCase
    device: str

    @classmethod
    def pytest_generate_tests(cls, metafunc: pytest.Metafunc) -> None:
        if "case" not in metafunc.fixturenames:
            return
        backends = list(cls.backends or metafunc.config.getoption("--spec-backend") or [])
        if not backends:
            from plugserve.plugins import get_plugin_host

            backends = get_plugin_host().registries.attention.names()
        metafunc.parametrize("case", spec_cases(backends), ids=str)

    @pytest.fixture(autouse=True)
    def _spec_gate(self, request: pytest.FixtureRequest, spec_target: SpecAlgorithmUnderTest,
                   spec_requirements: SpecRequirements, conformance_device: str | None) -> None:
        gate(request, type(self), spec_requirements)
        case: SpecCase = request.node.callspec.params["case"]
        device = conformance_device or default_device(case.backend)
        reason = refusal(case, spec_target.name, device,
                         spec_target.capabilities.needs_draft_model)
        if reason is not None:
            pytest.skip(reason)
        self.target, self.case, self.device = spec_target, case, device

    def models(self, factory: pytest.TempPathFactory) -> tuple[Path, str | None]:
        """The tiny target and the algorithm's draft for it (None when it needs none)."""
        folder = factory.getbasetemp() / f"spec_conformance_{self.target.name}"
        target, draft = spec_models(self.target.algorithm_class, str(folder))
        if draft is None and self.target.capabilities.needs_draft_model:
            pytest.fail(
                f"speculative algorithm {self.target.name!r} declares needs_draft_model but "
                f"{self.target.algorithm_class.__name__}.build_test_draft returned None: "
                "implement it so the suite can build a draft for a tiny target")
        return target, None if draft is None else str(draft)


class TestSpecFootprint(SpecConformanceTest):
    """What `plan_footprint` promises, for every allowed combination (no engine needed)."""

    def test_footprint_covers_a_round_and_fits_the_rows(self, case: SpecCase) -> None:
        from plugserve.config import EngineConfig

        config = EngineConfig(spec=self.target.name, draft_model="draft", device=self.device,
                              **case.overrides())
        fp = self.target.algorithm_class.plan_footprint(config)
        for name in ("alloc_len_per_decode", "reserve_len", "extra_row_width"):
            value = getattr(fp, name)
            assert isinstance(value, int) and value >= 0, f"{name} = {value!r}"
        assert fp.alloc_len_per_decode >= 1, fp
        # A round needs its footprint past where it starts; under the overlap loop it starts
        # up to one round later than the committed length the scheduler tops up from.
        need = fp.alloc_len_per_decode * (2 if case.overlap else 1)
        assert fp.reserve_len >= need, (
            f"reserve_len {fp.reserve_len} < {need} (alloc_len_per_decode "
            f"{fp.alloc_len_per_decode}{' x 2 under the overlap loop' if case.overlap else ''})")
        assert fp.extra_row_width >= fp.reserve_len, (
            f"extra_row_width {fp.extra_row_width} < reserve_len {fp.reserve_len}: a request "
            "near the end of the context could not hold its reserve in its row")


class TestSpecLossless(SpecConformanceTest, EngineTest):
    def plain(self, model_dir: Path) -> list[list[int]]:
        key = (str(model_dir), self.case.backend, self.case.page_size, self.device)
        if key not in _PLAIN:
            prompts, max_new = workload()
            with self.engine(model=str(model_dir), attention=self.case.backend,
                             page_size=self.case.page_size, dtype="float32",
                             device=self.device) as engine:
                _PLAIN[key] = [r.token_ids for r in generate_greedy(engine, prompts, max_new)]
        return _PLAIN[key]

    def test_lossless_and_the_law(self, case: SpecCase,
                                  tmp_path_factory: pytest.TempPathFactory) -> None:
        model_dir, draft = self.models(tmp_path_factory)
        expected = self.plain(model_dir)
        prompts, max_new = workload()
        with self.engine(model=str(model_dir), dtype="float32", device=self.device,
                         spec=self.target.name, draft_model=draft,
                         **case.overrides()) as engine:
            spec: Any = engine.spec
            planned = type(spec).plan_footprint(engine.config)
            assert spec.footprint == planned, (
                f"the instance's footprint {spec.footprint} differs from plan_footprint's "
                f"{planned} (the engine sizes rows from the classmethod)")
            probe = FootprintProbe(engine, exact=not case.overlap)
            for i in range(2):  # the second call starts from a warm prefix cache
                results = generate_greedy(engine, prompts, max_new)
                assert_tokens([r.token_ids for r in results], expected,
                              f"{self.target.name!r} {case}, call {i + 1}: speculative greedy "
                              "output differs from plain greedy")
                assert_checked_and_whole(engine)
                rounds = sum(r.stats.get("spec_verify_steps", 0) for r in results)
                assert rounds > 0, "no request ran a speculative round"
        probe.assert_clean()
