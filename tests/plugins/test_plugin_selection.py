"""Which plugins load: the allowlist, `--plugin NAME`, `--plugin no:NAME`, unknown names.

Uses the dummy plugins: install them first with `bash tests/dummy_plugins/install.sh`.
"""

from __future__ import annotations

import pytest

from plugserve.plugins import (
    PluginError,
    PluginHost,
    get_plugin_host,
    load_plugins,
    parse_allowlist,
    parse_plugin_options,
)

pytestmark = pytest.mark.usefixtures("dummy_plugins")


def loaded(host: PluginHost) -> set[str]:
    return {info.name for info in host.plugins}


def test_parse_plugin_options_splits_enabled_and_disabled() -> None:
    assert parse_plugin_options(["good", " no:triton ", ""]) == (["good"], ["triton"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["no:builtin"], "plugin 'builtin' is essential and cannot be disabled"),
        (["no:"], "--plugin no: needs a plugin name"),
        (["good", "no:good"], "good both enabled and disabled"),
    ],
)
def test_bad_plugin_options_are_refused(options: list[str], message: str) -> None:
    with pytest.raises(PluginError, match=message):
        parse_plugin_options(options)


def test_disabling_builtin_is_refused_by_the_host_too() -> None:
    with pytest.raises(PluginError, match="essential"):
        get_plugin_host(disabled=["builtin"])


def test_allowlist_syntax() -> None:
    assert parse_allowlist(None) is None
    assert parse_allowlist("") == frozenset()
    assert parse_allowlist(" good , ,fa3") == frozenset({"good", "fa3"})


def test_unset_allowlist_loads_every_installed_plugin() -> None:
    host = get_plugin_host(strict=False)
    assert {"builtin", "good", "duplicate_name"} <= loaded(host)
    failed = {f.name for f in host.failures if f.distribution.startswith("plugserve-dummy-")}
    assert failed == {"broken_import", "misspelt_hook", "bad_signature"}


def test_empty_allowlist_loads_builtins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLUGSERVE_PLUGINS", "")
    host = get_plugin_host()
    assert loaded(host) == {"builtin"}
    assert host.failures == []
    assert "dummy_attention" not in host.registries.attention
    assert "torch_native" in host.registries.attention
    skipped = {s.name: s.reason for s in host.skipped}
    assert skipped["good"] == "not in PLUGSERVE_PLUGINS=''"


def test_allowlist_names_the_plugins_to_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLUGSERVE_PLUGINS", "good,broken_import")
    host = get_plugin_host()
    assert loaded(host) == {"builtin", "good"}
    assert [f.name for f in host.failures] == ["broken_import"]


def test_explicit_allowlist_argument_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PLUGSERVE_PLUGINS", "good")
    assert loaded(get_plugin_host(allowlist="")) == {"builtin"}


def test_plugin_option_loads_a_plugin_outside_the_allowlist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PLUGSERVE_PLUGINS", "")
    host = load_plugins(["good"])
    assert loaded(host) == {"builtin", "good"}
    assert "dummy_attention" in host.registries.attention


def test_no_plugin_blocks_an_installed_plugin() -> None:
    host = load_plugins(["no:good", "no:duplicate_name"])
    assert "good" not in loaded(host)
    assert "dummy_attention" not in host.registries.attention
    reasons = {s.name: s.reason for s in host.skipped}
    assert reasons["good"] == "disabled with --plugin no:good"


def test_unknown_plugin_name_lists_the_installed_ones() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(["gooood"])
    message = str(info.value)
    assert "--plugin names unknown plugin(s) gooood" in message
    assert "installed: bad_signature, broken_import, builtin" in message
    assert "good" in message


def test_unknown_disabled_name_is_refused_too() -> None:
    with pytest.raises(PluginError, match="unknown plugin"):
        load_plugins(["no:gooood"])


def test_unknown_allowlist_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLUGSERVE_PLUGINS", "good,typo_plugin")
    with pytest.raises(
        PluginError, match=r"PLUGSERVE_PLUGINS names unknown plugin\(s\) typo_plugin"
    ):
        get_plugin_host()


def test_a_selection_loads_once_per_process() -> None:
    first = load_plugins(["no:duplicate_name"])
    assert load_plugins(["no:duplicate_name"]) is first
    assert get_plugin_host(disabled=["duplicate_name"], refresh=True) is not first


def test_forcing_a_plugin_that_fails_is_an_error() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(["broken_import"], allowlist="")
    message = str(info.value)
    assert "plugin 'broken_import' (plugserve-dummy-broken-import) failed at import" in message
    assert "requested with --plugin broken_import" in message
