"""Every bad input ends as one clear line on stderr, exit code 1, and no traceback unless
`--debug`.

Uses the dummy plugins: install them first with `bash tests/dummy_plugins/install.sh`.
The allowlist is set in each case so no warning about other broken plugins joins the line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("dummy_plugins")


CASES: dict[str, tuple[list[str], str, str]] = {
    # case: (arguments, PLUGSERVE_PLUGINS, the start of the error line)
    "unknown plugin": (
        ["generate", "hi", "--plugin", "gooood"],
        "",
        "error: --plugin names unknown plugin(s) gooood; installed: ",
    ),
    "unknown plugin in the allowlist": (
        ["generate", "hi"],
        "good,typo_plugin",
        "error: PLUGSERVE_PLUGINS names unknown plugin(s) typo_plugin; installed: ",
    ),
    "disabling an essential built-in": (
        ["generate", "hi", "--plugin", "no:builtin"],
        "",
        "error: plugin 'builtin' is essential and cannot be disabled (--plugin no:builtin); "
        "essential plugins: builtin",
    ),
    "two plugins registering one name": (
        ["generate", "hi"],
        "duplicate_name",
        "error: attention backend 'torch_native' is registered twice: by plugin 'builtin' "
        "(plugserve 0.1.0) and by plugin 'duplicate_name' (plugserve-dummy-duplicate-name "
        "0.1.0); uninstall one, or disable it with --plugin no:duplicate_name",
    ),
    "hook with a wrong signature": (
        ["generate", "hi", "--plugin", "bad_signature"],
        "",
        "error: plugin 'bad_signature' (plugserve-dummy-bad-signature) failed at validate: "
        "hook plugserve_register_cache_policies takes options, which its spec does not pass "
        "(it passes: register) (it was requested with --plugin bad_signature)",
    ),
    "misspelt hook": (
        ["generate", "hi", "--plugin", "misspelt_hook"],
        "",
        "error: plugin 'misspelt_hook' (plugserve-dummy-misspelt-hook) failed at validate: "
        "unknown hook plugserve_register_attention_backend (did you mean "
        "plugserve_register_attention_backends?)",
    ),
    "plugin that cannot be imported": (
        ["generate", "hi", "--plugin", "broken_import"],
        "",
        "error: plugin 'broken_import' (plugserve-dummy-broken-import) failed at import: "
        "ImportError: ",
    ),
    "page_size>1 with topk>1 outside the whitelist": (
        [
            "generate",
            "hi",
            "--plugin",
            "good",
            "--attention",
            "dummy_attention",
            "--spec",
            "dummy_spec",
            "--page-size",
            "4",
            "--spec-topk",
            "2",
        ],
        "",
        "error: unsupported configuration: attention backend 'dummy_attention' (plugin 'good' "
        "(plugserve-dummy-good 0.2.0)) may not run page_size>1 (page_size=4) with topk>1 "
        "(spec_topk=2); allowed backends: torch_native (plugserve), triton "
        "(plugserve-attention-triton), flashinfer (plugserve-attention-flashinfer), fa3 "
        "(plugserve-attention-fa3)",
    ),
    "several unsupported settings at once": (
        ["generate", "hi", "--attention", "nope", "--cache", "lru"],
        "",
        "error: unsupported configuration: unknown attention backend 'nope'; available: "
        "torch_native; unknown cache policy 'lru'; available: none, radix",
    ),
    "invalid config value": (
        ["generate", "hi", "--page-size", "0"],
        "",
        "error: invalid configuration: page_size=0: Input should be greater than or equal to 1",
    ),
    "invalid device": (
        ["generate", "hi", "--device", "tpu"],
        "",
        "error: invalid configuration: device='tpu': device must be 'cpu' or 'cuda[:N]', got 'tpu'",
    ),
    "invalid sampling values": (
        ["generate", "hi", "--top-p", "0", "--max-new-tokens", "0"],
        "",
        # (only the start of the top_p reason: core/sampling.py words the allowed range)
        "error: invalid sampling options: max_new_tokens must be >= 1, got 0; top_p must be ",
    ),
    "no prompt": (["generate"], "", "error: no prompt given: stdin was empty"),
    "missing model folder": (
        ["generate", "hi", "--model", "/nonexistent/model"],
        "",
        "error: /nonexistent/model: model folder does not exist",
    ),
    "plugins: disabling an essential built-in": (
        ["plugins", "--plugin", "no:builtin"],
        "",
        "error: plugin 'builtin' is essential and cannot be disabled",
    ),
    "bench: unknown comparison": (
        ["bench", "--compare", "sglang"],
        "",
        "error: --compare 'sglang' is not supported; allowed: transformers, vllm, llamacpp",
    ),
    "bench: vllm comparison without its interpreter": (
        ["bench", "--compare", "vllm"],
        "",
        "error: --compare vllm needs --vllm-python PATH, an interpreter with vLLM: ",
    ),
    "bench: prompts shorter than the workload's minimum": (
        ["bench", "--max-input-len", "8"],
        "",
        "error: invalid benchmark options: max_input_len must be >= 16, got 8",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_without_traceback(cli: Callable[..., Any], case: str) -> None:
    args, allowlist, expected = CASES[case]
    run = cli(*args, env={"PLUGSERVE_PLUGINS": allowlist})
    assert run.exit_code == 1, run.stderr
    assert len(run.stderr_lines) == 1, run.stderr
    assert run.stderr_lines[0].startswith(expected), run.stderr
    assert "Traceback" not in run.stderr + run.stdout


def test_unknown_plugin_lists_every_installed_one(cli: Callable[..., Any]) -> None:
    from plugserve.plugins import installed_entry_points

    names = sorted({ep.name for ep in installed_entry_points()} | {"builtin"})
    assert {"good", "broken_import", "duplicate_name"} <= set(names)
    run = cli("generate", "hi", "--plugin", "gooood", env={"PLUGSERVE_PLUGINS": ""})
    assert run.stderr_lines[0].endswith("; installed: " + ", ".join(names))


@pytest.mark.parametrize(
    "case", ["unknown plugin", "two plugins registering one name", "missing model folder"]
)
def test_debug_adds_the_traceback(cli: Callable[..., Any], case: str) -> None:
    args, allowlist, expected = CASES[case]
    run = cli(*args, "--debug", env={"PLUGSERVE_PLUGINS": allowlist})
    assert run.exit_code == 1
    assert run.stderr.startswith("Traceback (most recent call last):")
    assert run.stderr_lines[-1].startswith(expected)
