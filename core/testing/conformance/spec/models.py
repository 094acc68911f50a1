"""The tiny target model of the speculative suite and the algorithm's draft for it
(`SpecAlgorithm.build_test_draft`), built in a child process, once per algorithm and test
session.

A child process, because building them imports libraries that change how this process's
attention backends start: transformers and an optimizer import triton, after which Triton can
no longer switch to its CPU interpreter here. The engine itself reads the folders without
them.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
from pathlib import Path

from plugserve.spec.base import SpecAlgorithm

TARGET_ARCH = "llama"  # plugserve.testing.tiny_models: 2 layers, 64 hidden, 261-token vocab


def _build(module: str, qualname: str, folder: str) -> tuple[str, str | None]:
    from plugserve.testing.tiny_models import make_tiny_model_dir

    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type) or not issubclass(obj, SpecAlgorithm):
        raise TypeError(f"{module}.{qualname} is not a SpecAlgorithm subclass")
    algorithm: type[SpecAlgorithm] = obj
    target = make_tiny_model_dir(Path(folder) / "target", arch=TARGET_ARCH, seed=0)
    draft = algorithm.build_test_draft(target, Path(folder) / "draft")
    return str(target), None if draft is None else str(draft)


@functools.cache
def spec_models(algorithm: type[SpecAlgorithm], folder: str) -> tuple[Path, Path | None]:
    """(target folder, draft folder or None) under `folder`, built in a child process."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        target, draft = pool.apply(_build, (algorithm.__module__, algorithm.__qualname__,
                                            folder))
    return Path(target), None if draft is None else Path(draft)
