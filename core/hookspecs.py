"""Every plugserve hook spec, under the one marker "plugserve".

Registration hooks get a `register` callable instead of returning values, so that every
plugin adds what it has and the core later picks one thing *by name*; registration order
never decides. Lifecycle hooks let an invariant checker (or any observer) see the engine's
state at fixed points; they must not change it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from plugserve.config import EngineConfig
    from plugserve.registry import (
        RegisterAttentionBackend,
        RegisterCachePolicy,
        RegisterFixToggle,
        RegisterGrammarBackend,
        RegisterInvariantChecker,
        RegisterSpecAlgorithm,
        RegisterToolParser,
    )

PROJECT_NAME = "plugserve"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- registration (called once per process, when plugins are loaded) ---------------------


@hookspec
def plugserve_register_attention_backends(register: RegisterAttentionBackend) -> None:
    """Register attention backends.

    Called once, when the plugin manager first loads plugins. Call
    `register(name, loader, capabilities, description=...)` for each backend: `loader` is a
    zero-argument callable returning the `AttentionBackend` subclass; it is only called when
    that backend is selected, so heavy imports (triton, flashinfer) belong inside it.
    `capabilities` is a `BackendCapabilities`. Return nothing.
    """


@hookspec
def plugserve_register_spec_algorithms(register: RegisterSpecAlgorithm) -> None:
    """Register speculative decoding algorithms.

    Called once at plugin load. Call `register(name, loader, capabilities, description=...)`;
    `loader()` returns the algorithm's class (see `plugserve.spec.SpecAlgorithm`).
    Return nothing.
    """


@hookspec
def plugserve_register_cache_policies(register: RegisterCachePolicy) -> None:
    """Register prefix-cache policies (which KV survives a request).

    Called once at plugin load. Call `register(name, loader, capabilities, description=...)`;
    `loader()` returns a `PrefixCache` subclass. Return nothing.
    """


@hookspec
def plugserve_register_invariant_checkers(register: RegisterInvariantChecker) -> None:
    """Register invariant checkers.

    Called once at plugin load. Call `register(name, loader, description=...)`; `loader()`
    returns a checker class built as `cls(config)` and driven through the lifecycle hooks
    below (the engine passes each selected checker instance to
    `PluginHost.engine_hooks(observers)`, which relays that engine's lifecycle calls to it).
    Return nothing.
    """


@hookspec
def plugserve_register_fix_toggles(register: RegisterFixToggle) -> None:
    """Register named accounting-fix toggles (see `plugserve.fixes`).

    Called once at plugin load. Call `register(name, description)` for each toggle this plugin
    guards; `PLUGSERVE_REVERT_FIX=name` then puts that fix's old behaviour back. Return nothing.
    """


@hookspec
def plugserve_register_grammar_backends(register: RegisterGrammarBackend) -> None:
    """Register grammar backends (structured outputs: JSON schema, regex, choice, EBNF).

    Called once at plugin load. Call `register(name, loader, capabilities, description=...)`;
    `loader()` returns a `plugserve.grammar.GrammarBackend` subclass, built once per engine
    as `cls(GrammarContext)` the first time a request asks for structured output.
    `capabilities` is a `GrammarCapabilities` (the request kinds it compiles, rollback).
    Return nothing.
    """


@hookspec
def plugserve_register_tool_parsers(register: RegisterToolParser) -> None:
    """Register tool-call parsers: how a model family writes tool calls in its output.

    Called once at plugin load. Call `register(name, loader, description=...)`; `loader()`
    returns a `plugserve.tools.ToolParser` subclass. Return nothing.
    """


# --- lifecycle (called on instances the engine registered for one engine's lifetime) -------


@hookspec
def plugserve_engine_configured(config: EngineConfig, scheduler: Any) -> None:
    """The engine finished start-up with its final config; `scheduler` is built and idle.

    Called once per engine. Observers may keep references for later checks; they must not
    change engine state. Return nothing.
    """


@hookspec
def plugserve_after_step(scheduler: Any) -> None:
    """A scheduler step ended: its batch ran and its results were processed.

    Called after every busy step of the normal and the overlap loops. Raising an exception
    stops the engine from serving (the error reaches the caller). Return nothing.
    """


@hookspec
def plugserve_scheduler_idle(scheduler: Any) -> None:
    """The scheduler became truly idle: nothing waiting, running, chunked or in flight.

    Called once each time the engine finishes its queued work. Raising stops the engine.
    Return nothing.
    """

