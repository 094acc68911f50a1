"""What a first start prints while the CPU kernels compile, where stderr is not a terminal
(a log, CI): what is compiled, for which ISAs and why, a line per finished source, and a
heartbeat while a long one compiles (no step silent for long)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from plugserve.kernels import status as status_mod


def test_plain_lines_say_what_and_why_and_keep_a_heartbeat(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(status_mod, "HEARTBEAT_S", 0.3)
    status = status_mod.for_stderr("first start with this cache")
    assert isinstance(status, status_mod.LineStatus)  # pytest's stderr is no terminal
    try:
        status.begin(2, 1, ["scalar", "avx2"], time.monotonic())
        status.job_started("paged_decode [avx2]")
        deadline = time.monotonic() + 5.0
        while "still compiling" not in capsys.readouterr().err and time.monotonic() < deadline:
            time.sleep(0.1)
        status.job_done("paged_decode [avx2]", 1.5)
        status.linking()
        status.end(2.0, Path("/cache/x/plugserve_cpu.so"))
    finally:
        status.close()
    # (the headline and the heartbeat were read in the loop above)
    err = capsys.readouterr().err
    assert "[1/2] compiled paged_decode [avx2] in 1.5 s" in err
    assert "linking the kernels into one library" in err
    assert "CPU kernels ready in 2 s" in err
    assert time.monotonic() < deadline, "no heartbeat line while a source compiled"


def test_the_headline_names_the_isas_the_reason_and_the_cache() -> None:
    line = status_mod._headline("first start with this cache", ["scalar", "avx2"], 12, 3)
    assert line == (
        "Compiling plugserve's CPU kernels for scalar, avx2 (first start with this cache; "
        "12 sources, 3 reused; cached for later starts)"
    )
