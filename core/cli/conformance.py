"""`plugserve conformance`: run one plugin's conformance suite (an attention backend, a cache
policy, a speculative algorithm or a grammar backend)."""

from __future__ import annotations

from typing import Annotated

import typer

from plugserve.cli.errors import UsageError, reported_errors
from plugserve.cli.options import DebugOpt

CACHE_SUITE = "plugserve.testing.conformance.cache.suite"
SPEC_SUITE = "plugserve.testing.conformance.spec.suite"
GRAMMAR_SUITE = "plugserve.testing.conformance.grammar.suite"


def conformance_command(
    attention: Annotated[
        str | None,
        typer.Option("--attention", metavar="NAME",
                     help="Registered attention backend: run the attention-backend suite."),
    ] = None,
    cache: Annotated[
        str | None,
        typer.Option("--cache", metavar="NAME",
                     help="Registered cache policy: run the cache-policy suite."),
    ] = None,
    spec: Annotated[
        str | None,
        typer.Option("--spec", metavar="NAME",
                     help="Registered speculative algorithm: run the speculative suite."),
    ] = None,
    grammar: Annotated[
        str | None,
        typer.Option("--grammar", metavar="NAME",
                     help="Registered grammar backend: run the grammar-backend suite."),
    ] = None,
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", metavar="NAME",
                     help="With --spec: an attention backend to run on (repeatable; default: "
                     "every registered backend)."),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help="With --attention or --spec: cpu or cuda[:N] (default: cpu if the "
                     "backend declares it, else cuda). A device missing here skips with the "
                     "reason."),
    ] = None,
    keyword: Annotated[
        str | None,
        typer.Option("-k", "--keyword", metavar="EXPR", help="Only tests matching this pytest "
                     "-k expression (e.g. 'Kernel and not bf16')."),
    ] = None,
    smoke: Annotated[
        bool, typer.Option(help="With --attention: a few representative cases only (for slow "
                           "backends).")
    ] = False,
    pytest_args: Annotated[
        list[str] | None,
        typer.Argument(metavar="[-- PYTEST_ARGS]", help="Passed on to pytest, after --."),
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Run the conformance suite on one plugin; non-zero exit on any failure.

    Tests need the capabilities the plugin registered: what it does not declare is skipped
    with the reason. See docs/backends.md, docs/cache_policies.md, docs/spec_algorithms.md,
    docs/grammar_backends.md.
    """
    with reported_errors(debug):
        named = [f"--{flag} {name}" for flag, name in
                 (("attention", attention), ("cache", cache), ("spec", spec),
                  ("grammar", grammar)) if name]
        if len(named) != 1:
            raise UsageError("name exactly one plugin: --attention NAME, --cache NAME, "
                             f"--spec NAME or --grammar NAME (got {', '.join(named) or 'none'})")
        if smoke and not attention:
            raise UsageError("--smoke applies to --attention only")
        if backend and not spec:
            raise UsageError("--backend applies to --spec only (the backends the speculative "
                             "suite runs on)")
        if device and (cache or grammar):
            raise UsageError("--device applies to --attention and --spec; the cache-policy "
                             "and grammar-backend suites run on the CPU")
        from plugserve.plugins import get_plugin_host

        registries = get_plugin_host().registries
        args = list(pytest_args or ())
        if attention:
            registries.attention.get(attention)  # unknown: lists the names
            from plugserve.testing.conformance.runner import run_suite

            code = run_suite(attention, device=device, keyword=keyword, smoke=smoke,
                             pytest_args=args)
        elif grammar:
            registries.grammar.get(grammar)  # unknown: lists the names
            from plugserve.testing.conformance.pytest_run import run_module

            code = run_module(GRAMMAR_SUITE, ["--grammar-backend", grammar], keyword=keyword,
                              pytest_args=args)
        elif cache:
            registries.cache.get(cache)
            from plugserve.testing.conformance.pytest_run import run_module

            code = run_module(CACHE_SUITE, ["--cache-policy", cache], keyword=keyword,
                              pytest_args=args)
        else:
            assert spec is not None
            from plugserve.testing.conformance.pytest_run import run_module
            from plugserve.testing.conformance.spec.target import SpecAlgorithmUnderTest

            SpecAlgorithmUnderTest.resolve(spec)  # unknown or 'none': says so
            options = ["--spec-algorithm", spec]
            for name in backend or ():
                registries.attention.get(name)
                options += ["--spec-backend", name]
            if device:
                options += ["--conformance-device", device]
            code = run_module(SPEC_SUITE, options, keyword=keyword, pytest_args=args)
    if code != 0:
        raise typer.Exit(code)
