"""The xgrammar backend: compiles with `GrammarCompiler`, masks every constrained row of a
forward with one `BatchGrammarMatcher` fill and one `apply_token_bitmask_inplace`."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from plugserve.grammar import GrammarBackend, GrammarContext, GrammarError, GrammarMatcher
from plugserve.structured import GrammarSpec

# xgrammar's messages start with "[time] /path/file.cc:line: "; the rest is the reason.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def tokenizer_info(context: GrammarContext) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, read through a transformers fast tokenizer built
    on the engine's `tokenizers` one (xgrammar detects byte-level / byte-fallback from it)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=context.tokenizer.backend)
    return xgr.TokenizerInfo.from_huggingface(
        fast, vocab_size=context.vocab_size, stop_token_ids=sorted(context.eos_token_ids))


def _reason(exc: Exception) -> str:
    lines = [_LOCATION.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line)


class XGrammarBackend(GrammarBackend):
    def __init__(self, context: GrammarContext) -> None:
        super().__init__(context)
        self.info = tokenizer_info(context)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._bitmask = xgr.allocate_token_bitmask(1, self.info.vocab_size)

    def compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(spec.text, any_whitespace=False,
                                                         strict_mode=True)
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}',
                                                         any_whitespace=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text)
            if spec.kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in spec.choices)
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            if spec.kind == "ebnf":
                return self.compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"invalid {spec.kind}: {_reason(exc)}") from None
        raise GrammarError(f"xgrammar cannot compile kind {spec.kind!r}")

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        matcher: GrammarMatcher = xgr.GrammarMatcher(compiled)
        return matcher

    def apply_masks(self, logits: torch.Tensor, rows: list[int],
                    matchers: list[GrammarMatcher]) -> None:
        # One bitmask row per logits row (reused between steps); only `rows` are filled.
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.info.vocab_size)
        bitmask = self._bitmask[: logits.shape[0]]
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        width = min(self.info.vocab_size, logits.shape[1])
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        indices=rows, vocab_size=width)
        if logits.shape[1] > self.info.vocab_size:  # padding rows of the model: no token
            logits[torch.tensor(rows, device=logits.device), self.info.vocab_size:] = (
                float("-inf"))
