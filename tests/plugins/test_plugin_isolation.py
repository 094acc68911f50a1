"""A broken plugin is reported by name and distribution and the rest still load; two plugins
registering one name is a conflict, never decided by load order.

Uses the dummy plugins: install them first with `bash tests/dummy_plugins/install.sh`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from plugserve.attention.base import BackendCapabilities
from plugserve.hookspecs import hookimpl
from plugserve.plugins import PluginError, get_plugin_host, load_plugins


def failures_by_name(host: Any) -> dict[str, Any]:
    return {f.name: f for f in host.failures}


@pytest.mark.usefixtures("dummy_plugins")
class TestDummyPlugins:
    def test_broken_import_is_reported_and_the_rest_load(self) -> None:
        host = load_plugins(["no:duplicate_name"])
        failure = failures_by_name(host)["broken_import"]
        assert failure.stage == "import"
        assert failure.distribution == "plugserve-dummy-broken-import"
        assert "ImportError" in failure.error and "not_installed_anywhere" in failure.error
        assert "Traceback" in failure.detail
        assert failure.message().startswith(
            "plugin 'broken_import' (plugserve-dummy-broken-import) failed at import:"
        )
        assert "dummy_attention" in host.registries.attention

    def test_misspelt_hook_unregisters_the_plugin_and_names_the_hook(self) -> None:
        host = load_plugins(["no:duplicate_name"])
        failure = failures_by_name(host)["misspelt_hook"]
        assert failure.stage == "validate"
        assert failure.distribution == "plugserve-dummy-misspelt-hook"
        assert failure.error == (
            "unknown hook plugserve_register_attention_backend "
            "(did you mean plugserve_register_attention_backends?)"
        )
        assert not host.pm.has_plugin("misspelt_hook")
        assert "never_registered" not in host.registries.attention
        host.pm.check_pending()  # nothing unknown is left behind

    def test_wrong_hook_signature_unregisters_the_plugin(self) -> None:
        host = load_plugins(["no:duplicate_name"])
        failure = failures_by_name(host)["bad_signature"]
        assert failure.stage == "validate"
        assert failure.error == (
            "hook plugserve_register_cache_policies takes options, which its spec does not "
            "pass (it passes: register)"
        )
        assert not host.pm.has_plugin("bad_signature")
        assert "never_registered" not in host.registries.cache

    def test_duplicate_name_is_an_error_naming_both_plugins(self) -> None:
        with pytest.raises(PluginError) as info:
            get_plugin_host()
        assert str(info.value) == (
            "attention backend 'torch_native' is registered twice: by plugin 'builtin' "
            "(plugserve 0.1.0) and by plugin 'duplicate_name' "
            "(plugserve-dummy-duplicate-name 0.1.0); uninstall one, or disable it with "
            "--plugin no:duplicate_name"
        )

    def test_duplicate_keeps_the_first_registration_for_listing(self) -> None:
        host = get_plugin_host(strict=False)
        assert host.registries.attention.get("torch_native").plugin == "builtin"
        assert len(host.conflicts) == 1
        with pytest.raises(PluginError):
            host.raise_for_conflicts()

    def test_disabling_the_duplicate_resolves_the_conflict(self) -> None:
        host = load_plugins(["no:duplicate_name"])
        assert host.conflicts == []

    def test_good_plugin_metadata(self) -> None:
        host = load_plugins(["good"], allowlist="")
        info = next(p for p in host.plugins if p.name == "good")
        assert (info.distribution, info.version) == ("plugserve-dummy-good", "0.2.0")
        assert info.module == "plugserve_dummy_good"
        assert info.hooks == [
            "plugserve_register_attention_backends",
            "plugserve_register_cache_policies",
            "plugserve_register_fix_toggles",
            "plugserve_register_spec_algorithms",
        ]
        entry = host.registries.attention.get("dummy_attention")
        assert (entry.plugin, entry.distribution, entry.version) == (
            "good",
            "plugserve-dummy-good",
            "0.2.0",
        )


def _plugin(**hooks: Callable[..., Any]) -> SimpleNamespace:
    return SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def test_plugin_raising_while_registering_keeps_nothing(fake_plugins: Callable[..., None]) -> None:
    def attention(register: Any) -> None:
        register("half_done", lambda: object, BackendCapabilities())

    def cache(register: Any) -> None:
        raise RuntimeError("cannot decide")

    fake_plugins(
        flaky=_plugin(
            plugserve_register_attention_backends=attention,
            plugserve_register_cache_policies=cache,
        ),
        fine=_plugin(
            plugserve_register_cache_policies=lambda register: register(
                "fine_cache", lambda: object
            )
        ),
    )
    host = get_plugin_host()
    failure = failures_by_name(host)["flaky"]
    assert failure.stage == "register"
    assert failure.error == "RuntimeError: cannot decide"
    assert "half_done" not in host.registries.attention
    assert not host.pm.has_plugin("flaky")
    assert [p.name for p in host.plugins] == ["builtin", "fine"]
    assert "fine_cache" in host.registries.cache


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda register: register("x", "not callable", BackendCapabilities()),
            "loader must be a zero-argument",
        ),
        (
            lambda register: register("", lambda: object, BackendCapabilities()),
            "name must be a non-empty string",
        ),
        (
            lambda register: register("x", lambda: object, {"devices": ["cpu"]}),
            "must be a BackendCapabilities",
        ),
        (
            lambda register: register("x", lambda: object),
            "must be a BackendCapabilities, got NoneType",
        ),
    ],
)
def test_bad_registration_is_a_register_failure(
    fake_plugins: Callable[..., None], call: Callable[[Any], None], message: str
) -> None:
    fake_plugins(bad=_plugin(plugserve_register_attention_backends=call))
    host = get_plugin_host()
    assert message in failures_by_name(host)["bad"].error


def test_same_name_twice_within_one_plugin_is_a_conflict(
    fake_plugins: Callable[..., None],
) -> None:
    def cache(register: Any) -> None:
        register("twice", lambda: object)
        register("twice", lambda: object)

    fake_plugins(double=_plugin(plugserve_register_cache_policies=cache))
    with pytest.raises(PluginError, match="cache policy 'twice' is registered twice"):
        get_plugin_host()


def test_entry_point_named_builtin_is_not_loaded(fake_plugins: Callable[..., None]) -> None:
    fake_plugins(builtin=_plugin())
    host = get_plugin_host()
    assert [s.reason for s in host.skipped] == [
        "the name 'builtin' is reserved for plugserve's own plugin"
    ]
