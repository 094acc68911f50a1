"""Per-request sampling parameters, validated so a bad request is rejected on its own."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# The smallest positive temperature accepted. Sampling divides the logits by the temperature,
# so a tiny one (1e-45) overflows them to inf and the softmax to NaN. Positive values below
# this bound are *rejected*, not treated as greedy (SGLang silently switches to greedy below
# ~1e-5): a client asking for 1e-6 gets an error that says to pass 0 for greedy.
MIN_TEMPERATURE = 1e-5

# The seeds torch.Generator.manual_seed accepts.
_SEED_MIN = -(1 << 63)
_SEED_MAX = (1 << 64) - 1


def is_int(value: object) -> bool:
    """An integer (Python or numpy), not a bool and not a float holding an integer."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A real number (int or float, Python or numpy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def describe(value: object) -> str:
    """A value and its type for an error message: `2.5 (float)`, `'a' (str)`."""
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({type(value).__name__})"


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    # 0 = greedy; otherwise a finite number >= MIN_TEMPERATURE (smaller ones are rejected).
    temperature: float = 0.0
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: bool = False

    def problems(self, vocab_size: int) -> list[str]:
        """Every reason these parameters are invalid (empty = valid). Never raises, whatever
        the field values are (wrong types included)."""
        out: list[str] = []
        if not is_int(self.max_new_tokens):
            out.append(f"max_new_tokens must be an int, got {describe(self.max_new_tokens)}")
        elif self.max_new_tokens < 1:
            out.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        t = self.temperature
        if not is_real(t):
            out.append(f"temperature must be a number (0 for greedy), got {describe(t)}")
        elif t != 0 and not (math.isfinite(t) and t >= MIN_TEMPERATURE):
            hint = (
                f"; positive values below {MIN_TEMPERATURE:g} are rejected, not treated as "
                "greedy: pass 0 for greedy"
                if 0 < t < MIN_TEMPERATURE
                else ""
            )
            out.append(
                f"temperature must be 0 (greedy) or a finite number >= "
                f"{MIN_TEMPERATURE:g}, got {t}{hint}"
            )
        if not is_real(self.top_p):
            out.append(f"top_p must be a number in (0, 1], got {describe(self.top_p)}")
        elif not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            out.append(f"top_p must be a finite number in (0, 1], got {self.top_p}")
        if not is_int(self.top_k):
            out.append(f"top_k must be an int (-1 = off), got {describe(self.top_k)}")
        elif self.top_k == 0 or self.top_k < -1:
            out.append(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not is_real(self.min_p):
            out.append(f"min_p must be a number in [0, 1], got {describe(self.min_p)}")
        elif not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            out.append(f"min_p must be a finite number in [0, 1], got {self.min_p}")
        if self.seed is not None:
            if not is_int(self.seed):
                out.append(f"seed must be None or an int, got {describe(self.seed)}")
            elif not _SEED_MIN <= self.seed <= _SEED_MAX:
                out.append(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        out += self._stop_problems(vocab_size)
        for name in ("ignore_eos", "logprobs"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                out.append(f"{name} must be a bool, got {describe(value)}")
        return out

    def _stop_problems(self, vocab_size: int) -> list[str]:
        out: list[str] = []
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)):
            out.append(f"stop_token_ids must be a tuple of ints, got {describe(ids)}")
        else:
            not_ints = [t for t in ids if not is_int(t)]
            if not_ints:
                out.append(
                    "stop_token_ids must be ints, got "
                    + ", ".join(describe(t) for t in not_ints[:5])
                )
            bad_ids = [t for t in ids if is_int(t) and not 0 <= t < vocab_size]
            if bad_ids:
                out.append(
                    f"unknown stop token id(s) {bad_ids}; the vocabulary has {vocab_size} ids"
                )
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, (tuple, list)):
            out.append(f"stop must be a tuple of strings, got {describe(stop)}")
        elif any(not isinstance(s, str) for s in stop):
            out.append(
                "stop strings must be str, got "
                + ", ".join(describe(s) for s in stop if not isinstance(s, str))
            )
        elif any(not s for s in stop):
            out.append("stop strings must not be empty")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
