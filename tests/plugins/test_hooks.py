"""Every hook spec is called, with what its docstring promises; a meta-test keeps it so.

`HOOK_TESTS` maps each hook in `plugserve.hookspecs` to the test that calls it. Adding a
hook spec without a test here, or without an entry in docs/hooks.md, fails
`test_every_hook_spec_has_a_test_and_documentation`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from plugserve.attention.base import BackendCapabilities
from plugserve.config import EngineConfig
from plugserve.grammar import GrammarCapabilities
from plugserve.hookspecs import hookimpl
from plugserve.plugins import PluginError, get_plugin_host, hook_spec_names
from plugserve.registry import CachePolicyCapabilities, SpecCapabilities

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """An observer (checker-shaped: built as `cls(config)`) that records every lifecycle call."""

    instances: ClassVar[list[Recorder]] = []

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.calls: list[str] = []
        Recorder.instances.append(self)

    @hookimpl
    def plugserve_engine_configured(self, config: EngineConfig, scheduler: Any) -> None:
        assert config is self.config
        self.calls.append("engine_configured")

    @hookimpl
    def plugserve_after_step(self, scheduler: Any) -> None:
        self.calls.append("after_step")

    @hookimpl
    def plugserve_scheduler_idle(self, scheduler: Any) -> None:
        self.calls.append("scheduler_idle")


def _every_hook_plugin() -> SimpleNamespace:
    def attention(register: Any) -> None:
        register(
            "hook_attention", lambda: "attention-class", BackendCapabilities(), description="d"
        )

    def spec(register: Any) -> None:
        register("hook_spec", lambda: "spec-class", SpecCapabilities(overlap=False))

    def cache(register: Any) -> None:
        register("hook_cache", lambda: "cache-class")

    def checkers(register: Any) -> None:
        register("recorder", lambda: Recorder, "records lifecycle calls")

    def toggles(register: Any) -> None:
        register("hook_toggle", "a toggle from the hook test")

    def grammar(register: Any) -> None:
        register("hook_grammar", lambda: "grammar-class",
                 GrammarCapabilities(kinds=frozenset({"regex"})))

    def tool_parsers(register: Any) -> None:
        register("hook_tools", lambda: "parser-class", "a parser from the hook test")

    return SimpleNamespace(
        plugserve_register_attention_backends=hookimpl(attention),
        plugserve_register_spec_algorithms=hookimpl(spec),
        plugserve_register_cache_policies=hookimpl(cache),
        plugserve_register_invariant_checkers=hookimpl(checkers),
        plugserve_register_fix_toggles=hookimpl(toggles),
        plugserve_register_grammar_backends=hookimpl(grammar),
        plugserve_register_tool_parsers=hookimpl(tool_parsers),
    )


@pytest.fixture
def every_hook(fake_plugins: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    """Installs a plugin implementing every registration hook."""
    monkeypatch.setattr(Recorder, "instances", [])
    fake_plugins(every_hook=_every_hook_plugin())


@pytest.mark.usefixtures("every_hook")
def test_register_hooks_get_a_registrar() -> None:
    regs = get_plugin_host().registries
    attention = regs.attention.get("hook_attention")
    assert (attention.load(), attention.description, attention.plugin) == (
        "attention-class",
        "d",
        "every_hook",
    )
    assert regs.spec.get("hook_spec").capabilities == SpecCapabilities(overlap=False)
    assert regs.cache.get("hook_cache").capabilities == CachePolicyCapabilities()
    checker = regs.checkers.get("recorder")
    assert checker.load() is Recorder and checker.description == "records lifecycle calls"
    assert get_plugin_host().fix_toggles["hook_toggle"] == "a toggle from the hook test"
    grammar = regs.grammar.get("hook_grammar")
    assert grammar.load() == "grammar-class"
    assert grammar.capabilities == GrammarCapabilities(kinds=frozenset({"regex"}))
    tools = regs.tool_parsers.get("hook_tools")
    assert (tools.load(), tools.description) == ("parser-class", "a parser from the hook test")


@pytest.mark.usefixtures("every_hook")
def test_lifecycle_hooks_are_relayed_to_one_engines_observers() -> None:
    host = get_plugin_host()
    config = EngineConfig()
    mine, other = Recorder(config), Recorder(config)
    hooks = host.engine_hooks([mine]).hook
    scheduler = object()
    hooks.plugserve_engine_configured(config=config, scheduler=scheduler)
    hooks.plugserve_after_step(scheduler=scheduler)
    hooks.plugserve_scheduler_idle(scheduler=scheduler)
    assert mine.calls == ["engine_configured", "after_step", "scheduler_idle"]
    assert other.calls == []
    host.engine_hooks([other]).hook.plugserve_after_step(scheduler=scheduler)
    assert mine.calls[-1] == "scheduler_idle" and other.calls == ["after_step"]


def test_observer_with_a_misspelt_hook_is_refused() -> None:
    class Typo:
        @hookimpl
        def plugserve_after_stepp(self, scheduler: Any) -> None: ...

    with pytest.raises(
        PluginError,
        match=r"observer Typo: unknown hook plugserve_after_stepp "
        r"\(did you mean plugserve_after_step\?\)",
    ):
        get_plugin_host(allowlist="").engine_hooks([Typo()])


@pytest.mark.usefixtures("every_hook")
def test_engine_calls_the_lifecycle_hooks(tiny_model_dir: Path) -> None:
    from plugserve.engine import Engine
    from plugserve.sampling import SamplingParams

    with Engine(EngineConfig(model=str(tiny_model_dir), mem_check=1)) as engine:
        engine.generate(["hello"], SamplingParams(max_new_tokens=3))
        (recorder,) = Recorder.instances
        assert recorder.config is engine.config
    assert recorder.calls[0] == "engine_configured"
    assert recorder.calls.count("engine_configured") == 1
    assert recorder.calls.count("after_step") >= 3  # one prefill and decode steps
    assert recorder.calls[-1] == "scheduler_idle"


HOOK_TESTS: dict[str, Callable[..., None]] = {
    "plugserve_register_attention_backends": test_register_hooks_get_a_registrar,
    "plugserve_register_spec_algorithms": test_register_hooks_get_a_registrar,
    "plugserve_register_cache_policies": test_register_hooks_get_a_registrar,
    "plugserve_register_invariant_checkers": test_register_hooks_get_a_registrar,
    "plugserve_register_fix_toggles": test_register_hooks_get_a_registrar,
    "plugserve_register_grammar_backends": test_register_hooks_get_a_registrar,
    "plugserve_register_tool_parsers": test_register_hooks_get_a_registrar,
    "plugserve_engine_configured": test_engine_calls_the_lifecycle_hooks,
    "plugserve_after_step": test_engine_calls_the_lifecycle_hooks,
    "plugserve_scheduler_idle": test_engine_calls_the_lifecycle_hooks,
}


def test_every_hook_spec_has_a_test_and_documentation() -> None:
    specs = hook_spec_names()
    assert sorted(HOOK_TESTS) == specs, "add the new hook's test to HOOK_TESTS"
    for test in HOOK_TESTS.values():
        assert globals()[test.__name__] is test
    docs = (ROOT / "docs" / "hooks.md").read_text(encoding="utf-8")
    undocumented = [name for name in specs if f"### `{name}`" not in docs]
    assert undocumented == [], f"document these hooks in docs/hooks.md: {undocumented}"
