"""Per-request sampling parameters, validated so a bad request is rejected on its own.

The fields are vLLM's (and OpenAI's where they overlap), with vLLM's meaning: logprobs are the
model's log-softmax before any sampling transform; `repetition_penalty` divides positive
(multiplies negative) logits of every token seen in the prompt or the output;
`frequency_penalty` / `presence_penalty` subtract per output occurrence / once per token seen in
the output; `logit_bias` adds to a token's logit; `min_tokens` masks EOS and `stop_token_ids`
until that many tokens were generated.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

from plugserve.structured import GrammarSpec

# The smallest positive temperature accepted. Sampling divides the logits by the temperature,
# so a tiny one (1e-45) overflows them to inf and the softmax to NaN. Positive values below
# this bound are *rejected*, not treated as greedy (SGLang silently switches to greedy below
# ~1e-5): a client asking for 1e-6 gets an error that says to pass 0 for greedy.
MIN_TEMPERATURE = 1e-5

# OpenAI's bounds for the additive penalties and for one token's logit bias.
MAX_ADDITIVE_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0

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
    logprobs: bool = False  # each output token's logprob
    top_logprobs: int = 0  # with logprobs: also the N most likely tokens at each output step
    # None = off; N >= 0: each prompt token's logprob given the tokens before it (the first
    # is None), plus the N most likely tokens. A request asking for them does not read the
    # prefix cache: every prompt position is computed.
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added logit
    min_tokens: int = 0
    skip_special_tokens: bool = True  # in the decoded text
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    # The output must match this grammar (JSON schema, regex, choice, EBNF); None = free.
    structured_outputs: GrammarSpec | None = None

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
        for name in ("ignore_eos", "logprobs", "skip_special_tokens",
                     "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                out.append(f"{name} must be a bool, got {describe(value)}")
        out += self._logprob_problems(vocab_size)
        out += self._logits_step_problems(vocab_size)
        so = self.structured_outputs
        if so is not None:
            out += (so.problems() if isinstance(so, GrammarSpec) else
                    [f"structured_outputs must be a GrammarSpec or None, got {describe(so)}"])
        return out

    def _logprob_problems(self, vocab_size: int) -> list[str]:
        out: list[str] = []
        n = self.top_logprobs
        if not is_int(n) or not 0 <= n <= vocab_size:
            out.append(f"top_logprobs must be an int in [0, {vocab_size}], got {describe(n)}")
        elif n > 0 and self.logprobs is not True:
            out.append(f"top_logprobs={n} needs logprobs=True")
        prompt_n = self.prompt_logprobs
        if prompt_n is not None and (not is_int(prompt_n) or not 0 <= prompt_n <= vocab_size):
            out.append(f"prompt_logprobs must be None or an int in [0, {vocab_size}], got "
                       f"{describe(prompt_n)}")
        return out

    def _logits_step_problems(self, vocab_size: int) -> list[str]:
        out: list[str] = []
        rp = self.repetition_penalty
        if not is_real(rp) or not (math.isfinite(rp) and rp > 0):
            out.append(f"repetition_penalty must be a finite number > 0 (1 = off), got "
                       f"{describe(rp)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not (math.isfinite(value)
                                          and abs(value) <= MAX_ADDITIVE_PENALTY):
                out.append(f"{name} must be a number in [-{MAX_ADDITIVE_PENALTY:g}, "
                           f"{MAX_ADDITIVE_PENALTY:g}], got {describe(value)}")
        bias = self.logit_bias
        if not isinstance(bias, Mapping):
            out.append(f"logit_bias must be a mapping of token id to number, got "
                       f"{describe(bias)}")
        else:
            bad_ids = [t for t in bias if not is_int(t) or not 0 <= t < vocab_size]
            if bad_ids:
                out.append(f"logit_bias has token ids outside the vocabulary "
                           f"(0..{vocab_size - 1}): {[describe(t) for t in bad_ids[:5]]}")
            bad = [v for v in bias.values()
                   if not is_real(v) or not (math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS)]
            if bad:
                out.append(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                           f"{MAX_LOGIT_BIAS:g}], got {[describe(v) for v in bad[:5]]}")
        m = self.min_tokens
        if not is_int(m) or m < 0:
            out.append(f"min_tokens must be an int >= 0, got {describe(m)}")
        elif is_int(self.max_new_tokens) and m > self.max_new_tokens:
            out.append(f"min_tokens ({m}) must not exceed max_new_tokens "
                       f"({self.max_new_tokens})")
        return out

    def decode_time_fields(self) -> list[str]:
        """The fields in use that act on every decode step's logits or logprobs (a speculative
        round verifies drafts without them)."""
        active = {
            "top_logprobs": self.top_logprobs != 0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "logit_bias": bool(self.logit_bias),
            "min_tokens": self.min_tokens != 0,
            "structured_outputs": self.structured_outputs is not None,
        }
        return [name for name, on in active.items() if on]

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

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
