"""The backend alone, on the tiny model's byte-level vocabulary: compiling, refusing invalid
input, masks equal to the exact oracle of `languages`, refused tokens, termination, batched
masks equal to one-row masks, rollback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.grammar.base import GrammarBackend, GrammarError
from plugserve.structured import GrammarSpec
from plugserve.testing.conformance.grammar.languages import INVALID, LANGUAGES, SCHEMAS, Language
from plugserve.testing.conformance.grammar.target import GrammarBackendUnderTest

SAMPLES: dict[str, GrammarSpec] = {
    **{kind: lang.spec for kind, lang in LANGUAGES.items()},
    "json_schema": GrammarSpec.json_schema(SCHEMAS[1]),
    "json_object": GrammarSpec.json_object(),
}


def token_texts(backend: GrammarBackend) -> dict[int, str]:
    """The text of every single-character ASCII token of the vocabulary."""
    backend_tok = backend.context.tokenizer.backend
    out: dict[int, str] = {}
    for token in range(backend.context.vocab_size):
        text = backend_tok.decode([token], skip_special_tokens=False)
        if len(text) == 1 and ord(text) < 128 and backend_tok.id_to_token(token) is not None:
            out[token] = text
    return out


def allowed(backend: GrammarBackend, matcher: Any) -> set[int]:
    logits = torch.zeros((2, backend.context.vocab_size))
    backend.apply_masks(logits, [1], [matcher])
    assert bool((logits[0] == 0).all()), "apply_masks changed a row it was not given"
    return set(torch.nonzero(torch.isfinite(logits[1])).flatten().tolist())


def expected(backend: GrammarBackend, texts: dict[int, str], lang: Language,
             prefix: str) -> set[int]:
    out = {t for t, s in texts.items() if lang.allows_next(prefix, s)}
    if lang.complete(prefix):
        out |= set(backend.context.eos_token_ids)
    return out


def tokens_of(texts: dict[int, str], word: str) -> list[int]:
    by_text = {s: t for t, s in sorted(texts.items(), reverse=True)}
    return [by_text[c] for c in word]


class TestGrammarKernel:
    @pytest.fixture
    def backend(self, grammar_target: GrammarBackendUnderTest,
                tiny_model_dir: Path) -> GrammarBackend:
        return grammar_target.build(tiny_model_dir)

    @pytest.mark.parametrize("kind", sorted(SAMPLES))
    def test_compiles_each_declared_kind(self, grammar_target: GrammarBackendUnderTest,
                                         backend: GrammarBackend, kind: str) -> None:
        grammar_target.require_kind(kind)
        matcher = backend.new_matcher(backend.compile(SAMPLES[kind]))
        assert not matcher.is_terminated()
        assert allowed(backend, matcher), f"{kind}: a fresh matcher allows no token"

    @pytest.mark.parametrize("kind", sorted(INVALID))
    def test_invalid_input_is_a_grammar_error(self, grammar_target: GrammarBackendUnderTest,
                                              backend: GrammarBackend, kind: str) -> None:
        grammar_target.require_kind(kind)
        with pytest.raises(GrammarError) as info:
            backend.compile(INVALID[kind])
        assert str(info.value), "a GrammarError must say what is wrong"

    @pytest.mark.parametrize("kind", sorted(LANGUAGES))
    def test_masks_are_exact_along_every_word(self, grammar_target: GrammarBackendUnderTest,
                                              backend: GrammarBackend, kind: str) -> None:
        grammar_target.require_kind(kind)
        lang = LANGUAGES[kind]
        texts = token_texts(backend)
        compiled = backend.compile(lang.spec)
        for word in sorted(lang.words):
            matcher = backend.new_matcher(compiled)
            for i, token in enumerate(tokens_of(texts, word)):
                prefix = word[:i]
                got, want = allowed(backend, matcher), expected(backend, texts, lang, prefix)
                assert got == want, (
                    f"{kind} {word!r} after {prefix!r}: mask allows {sorted(got - want)} it "
                    f"must not and forbids {sorted(want - got)} it must allow")
                assert matcher.accept_token(token), f"{kind}: refused {word[i]!r} of {word!r}"
            assert allowed(backend, matcher) == expected(backend, texts, lang, word)
            eos = min(backend.context.eos_token_ids)
            assert not matcher.is_terminated()
            assert matcher.accept_token(eos), f"{kind}: EOS refused after the whole {word!r}"
            assert matcher.is_terminated()

    @pytest.mark.parametrize("kind", sorted(LANGUAGES))
    def test_forbidden_token_is_refused_and_changes_nothing(
            self, grammar_target: GrammarBackendUnderTest, backend: GrammarBackend,
            kind: str) -> None:
        grammar_target.require_kind(kind)
        lang = LANGUAGES[kind]
        texts = token_texts(backend)
        matcher = backend.new_matcher(backend.compile(lang.spec))
        before = allowed(backend, matcher)
        bad = next(t for t in sorted(texts) if t not in before)
        assert not matcher.accept_token(bad)
        eos = min(backend.context.eos_token_ids)
        assert not matcher.accept_token(eos), f"{kind}: EOS accepted before anything matched"
        assert allowed(backend, matcher) == before

    def test_batched_masks_equal_one_row_masks(self, grammar_target: GrammarBackendUnderTest,
                                               backend: GrammarBackend) -> None:
        kinds = [k for k in sorted(LANGUAGES) if k in grammar_target.capabilities.kinds]
        if not kinds:
            pytest.skip("no kind with an exact oracle declared")
        texts = token_texts(backend)
        matchers = []
        for n, kind in enumerate(kinds * 2):
            lang = LANGUAGES[kind]
            matcher = backend.new_matcher(backend.compile(lang.spec))
            word = sorted(lang.words)[n % len(lang.words)]
            for token in tokens_of(texts, word)[: n % 3]:
                assert matcher.accept_token(token)
            matchers.append(matcher)
        generator = torch.Generator().manual_seed(0)
        rows = list(range(1, 2 * len(matchers), 2))  # every other row is left alone
        logits = torch.randn((2 * len(matchers) + 1, backend.context.vocab_size),
                             generator=generator)
        batched = logits.clone()
        backend.apply_masks(batched, rows, matchers)
        for row in range(logits.shape[0]):
            one = logits[row : row + 1].clone()
            if row in rows:
                backend.apply_masks(one, [0], [matchers[rows.index(row)]])
            assert torch.equal(batched[row], one[0]), f"row {row} differs from its own mask"

    @pytest.mark.parametrize("kind", sorted(LANGUAGES))
    def test_rollback_returns_to_the_earlier_state(
            self, grammar_target: GrammarBackendUnderTest, backend: GrammarBackend,
            kind: str) -> None:
        grammar_target.require_kind(kind)
        grammar_target.require_rollback()
        lang = LANGUAGES[kind]
        texts = token_texts(backend)
        word = max(sorted(lang.words), key=len)
        tokens = tokens_of(texts, word)
        matcher = backend.new_matcher(backend.compile(lang.spec))
        for token in tokens:
            assert matcher.accept_token(token)
        assert matcher.accept_token(min(backend.context.eos_token_ids))
        matcher.rollback(len(tokens))  # the EOS and all but the first token
        assert not matcher.is_terminated()
        assert allowed(backend, matcher) == expected(backend, texts, lang, word[:1])
        for token in tokens[1:]:
            assert matcher.accept_token(token)
        assert allowed(backend, matcher) == expected(backend, texts, lang, word)
