"""The running text of a stream (`plugserve.detokenize.IncrementalText`):
equal to decoding all of the tokens at every step, for byte-level BPE and SentencePiece-style
tokenizers, while decoding only a few tokens per step."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.detokenize import IncrementalText
from plugserve.sampling import SamplingParams
from plugserve.server.jobs import Event
from plugserve.server.output import Choice
from plugserve.testing import EngineTest
from plugserve.testing.tiny_models import make_tokenizer

TEXTS = [
    "Hello, world! The café serves crème brûlée at 5 €.",
    "Grüße aus Köln — 東京は晴れ、気温は２５度です。",
    "emoji 🙂🚀 and a family 👨‍👩‍👧 in one line",
    "  leading spaces,\ttabs\nand\n\nnew lines  ",
]


def _metaspace_tokenizer() -> Any:
    """A SentencePiece-style tokenizer (words with a leading ▁, whose decoder drops the first
    word's space) built in code: word-level over the test texts' words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for text in TEXTS for w in text.replace("\t", " ").split()})
    vocab = {"<unk>": 0, **{f"▁{w}": i + 1 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def _tokenizers() -> list[tuple[str, Any]]:
    return [("byte-level", make_tokenizer()), ("metaspace", _metaspace_tokenizer())]


def _counting(tokenizer: Any) -> tuple[Callable[[list[int]], str], list[int]]:
    decoded: list[int] = []

    def render(ids: list[int]) -> str:
        decoded.append(len(ids))
        return str(tokenizer.decode(ids))

    return render, decoded


@pytest.mark.parametrize("name, tokenizer", _tokenizers())
def test_running_text_equals_the_whole_decode_at_every_step(name: str, tokenizer: Any) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= 5, name
        for chunks in (1, 3, 7):  # tokens per event
            running = IncrementalText(lambda i: str(tokenizer.decode(i)))
            n = 0
            while n < len(ids):
                n = min(len(ids), n + rng.randint(1, chunks))
                assert running.text(ids[:n]) == tokenizer.decode(ids[:n]), (name, text, n)
            assert running.text(ids) == tokenizer.decode(ids) == tokenizer.decode(
                tokenizer.encode(text, add_special_tokens=False))


def test_random_bytes_come_out_as_the_whole_decode() -> None:
    """Byte tokens in any order (split and invalid UTF-8 sequences included)."""
    tokenizer = make_tokenizer()
    rng = random.Random(1)
    byte_ids = tokenizer.encode(bytes(range(256)).decode("latin-1"), add_special_tokens=False)
    for _ in range(30):
        ids = [rng.choice(byte_ids) for _ in range(60)]
        running = IncrementalText(lambda i: str(tokenizer.decode(i)))
        for n in range(1, len(ids) + 1):
            assert running.text(ids[:n]) == tokenizer.decode(ids[:n]), (ids, n)


def test_a_long_stream_decodes_each_token_a_few_times_only() -> None:
    """Decoding every token again for each event would decode n^2 / 2 ids (2,000,000 for
    2,000 tokens); the running text decodes each a few times."""
    tokenizer = make_tokenizer()
    ids = tokenizer.encode(" ".join(TEXTS) * 20, add_special_tokens=False)[:2000]
    render, decoded = _counting(tokenizer)
    running = IncrementalText(render)
    for n in range(1, len(ids) + 1):
        running.text(ids[:n])
    assert running.text(ids) == tokenizer.decode(ids)
    assert sum(decoded) < 6 * len(ids), sum(decoded)


def test_ids_that_shrank_start_the_decoding_over() -> None:
    tokenizer = make_tokenizer()
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    running = IncrementalText(lambda i: str(tokenizer.decode(i)))
    assert running.text(ids) == tokenizer.decode(ids)
    assert running.text(ids[:3]) == tokenizer.decode(ids[:3])
    assert running.text(ids[:9]) == tokenizer.decode(ids[:9])


@pytest.mark.parametrize("name, tokenizer", _tokenizers())
def test_a_streamed_choice_adds_up_to_the_whole_text(name: str, tokenizer: Any) -> None:
    """Choice.add's deltas (held back at stop strings, incomplete characters) add up to the
    final text, which is the whole decode cut at the stop string."""
    text = (TEXTS[1] + " ") * 4 + TEXTS[0][: TEXTS[0].index("brûlée") + len("brûlée")]
    ids = tokenizer.encode(text, add_special_tokens=False)  # the engine stops at the stop text
    render, decoded = _counting(tokenizer)
    choice = Choice(0, render, stop=("brûlée",))
    sent = ""
    for k, token in enumerate(ids):
        final = k == len(ids) - 1
        event = Event(kind="final" if final else "tokens", token_ids=[token],
                      finish_reason="stop" if final else None, stop_str="brûlée" if final else None)
        sent += choice.add(event).text
    whole = tokenizer.decode(ids)
    assert sent == choice.text == whole[: whole.index("brûlée")]
    assert sum(decoded) < 6 * len(ids) + len(ids)  # the windows, and one whole decode at the end


class TestEngineStreamText(EngineTest):
    @pytest.mark.parametrize("overlap", [False, True])
    def test_event_texts_add_up_to_the_decoded_output(self, tiny_model_dir: Path,
                                                      overlap: bool) -> None:
        """A random tiny model emits byte tokens in any order (characters split across
        tokens, invalid sequences): each request's event texts add up to its whole output
        decoded at once (with per-event decoding a character split over two events came out
        as two U+FFFD)."""
        prompts = ["a", "bonjour", "数字"]
        sampling = SamplingParams(max_new_tokens=48, ignore_eos=True, temperature=1.0, seed=3)
        with self.engine(model=str(tiny_model_dir), overlap=overlap) as engine:
            events = list(engine.stream(prompts, sampling))
            decode = engine.tokenizer.decode
        for i in range(len(prompts)):
            mine = [e for e in events if e.index == i]
            final = mine[-1]
            assert final.finished and final.result is not None
            ids = final.result.token_ids
            assert len(ids) == 48
            assert "".join(e.text for e in mine) == decode(ids), i
