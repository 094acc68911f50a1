"""Per-request sampling parameters, validated so a bad request is rejected on its own."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: bool = False

    def problems(self, vocab_size: int) -> list[str]:
        """Every reason these parameters are invalid (empty = valid)."""
        out: list[str] = []
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            out.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            out.append(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            out.append(f"min_p must be in [0, 1], got {self.min_p}")
        bad_ids = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad_ids:
            out.append(f"unknown stop token id(s) {bad_ids}; the vocabulary has {vocab_size} ids")
        if any(not s for s in self.stop):
            out.append("stop strings must not be empty")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
