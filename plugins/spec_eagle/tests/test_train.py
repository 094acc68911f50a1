"""Training an EAGLE head on a tiny target: determinism, learning, held-out accuracy, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from plugserve.model.llama import CausalLM
from plugserve_spec_eagle.features import target_hidden_states
from plugserve_spec_eagle.head import load_head
from plugserve_spec_eagle.testing import make_tiny_head_dir, tiny_prompts
from plugserve_spec_eagle.train import TrainReport, evaluate_top1, main, train_head
from plugserve_spec_eagle.train_data import (
    IGNORE,
    Example,
    collate,
    generate_continuations,
    read_prompts,
    select_draft_vocab,
)

DRAFT_VOCAB = 128



def run_training(model_dir: Path, out: Path, seed: int = 0) -> TrainReport:
    return train_head(
        str(model_dir), tiny_prompts(seed, count=96), out, seed=seed, max_new_tokens=40,
        draft_vocab_size=DRAFT_VOCAB, epochs=10, lr=3e-3, batch_size=8, chat=False,
        dtype_to_save="float32", ignore_eos=True, held_out_fraction=0.25,
    )


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainReport:
    return run_training(tiny_model_dir, tmp_path_factory.mktemp("head_a"))


def test_training_is_deterministic(
    report: TrainReport, tiny_model_dir: Path, tmp_path: Path
) -> None:
    again = run_training(tiny_model_dir, tmp_path / "head_b")
    first = load_file(str(report.out_dir / "model.safetensors"))
    second = load_file(str(again.out_dir / "model.safetensors"))
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name
    assert again.losses == report.losses
    assert again.held_out_top1 == report.held_out_top1


def test_loss_goes_down_and_accuracy_up(report: TrainReport) -> None:
    assert len(report.epochs) == 10
    assert report.losses[-1] < 0.75 * report.losses[0], report.losses
    assert all(b < a for a, b in zip(report.losses, report.losses[1:], strict=False)), report.losses
    assert report.accuracies[-1] > report.accuracies[0] + 0.15, report.accuracies
    assert report.epochs[-1].token_loss < report.epochs[0].token_loss
    assert report.epochs[-1].feature_loss < report.epochs[0].feature_loss


def test_report_counts(report: TrainReport) -> None:
    assert report.num_sequences == 96
    assert (report.train_sequences, report.held_out_sequences) == (72, 24)
    assert report.prompt_tokens == 96 * 6 and report.generated_tokens == 96 * 40
    # Targets are the generated tokens t_{i+2}: 40 per sequence.
    assert report.train_positions == 72 * 40 and report.held_out_positions == 24 * 40
    assert report.draft_vocab_size == DRAFT_VOCAB
    assert 0.5 < report.draft_vocab_coverage <= 1.0
    assert report.wall_s > 0 and set(report.phase_s) == {"generate_s", "features_s", "train_s"}
    saved = json.loads((report.out_dir / "train_report.json").read_text())
    assert saved["held_out_top1"] == report.held_out_top1
    assert "held-out top-1" in report.summary()


def test_held_out_accuracy_beats_untrained(report: TrainReport) -> None:
    assert report.held_out_top1 > report.held_out_top1_initial + 0.05, (
        report.held_out_top1, report.held_out_top1_initial)


def fresh_examples(target: CausalLM, model_dir: Path) -> list[Example]:
    _, seqs, prompt_lens = generate_continuations(
        str(model_dir), tiny_prompts(1234, count=24), seed=0, max_new_tokens=40, chat=False,
        ignore_eos=True,
    )
    feats = target_hidden_states(target, seqs)
    return [Example(s, p, f) for s, p, f in zip(seqs, prompt_lens, feats, strict=True)]


def test_tiny_head_dirs_on_fresh_text(tiny_model_dir: Path, tmp_path: Path) -> None:
    from plugserve.model import load_model

    target = load_model(tiny_model_dir, dtype=torch.float32, device="cpu").model
    trained_dir = make_tiny_head_dir(tiny_model_dir, tmp_path / "trained", trained=True,
                                     draft_vocab_size=DRAFT_VOCAB)
    random_dir = make_tiny_head_dir(tiny_model_dir, tmp_path / "random", trained=False,
                                    draft_vocab_size=DRAFT_VOCAB)
    trained = load_head(trained_dir, target)
    untrained = load_head(random_dir, target)
    assert trained.config.draft_vocab_size == untrained.config.draft_vocab_size == DRAFT_VOCAB
    again = load_head(make_tiny_head_dir(tiny_model_dir, tmp_path / "random2", trained=False,
                                         draft_vocab_size=DRAFT_VOCAB), target)
    assert all(torch.equal(a, b) for a, b in zip(untrained.state_dict().values(),
                                                 again.state_dict().values(), strict=True))
    examples = fresh_examples(target, tiny_model_dir)
    trained_top1, n = evaluate_top1(trained, examples)
    untrained_top1, _ = evaluate_top1(untrained, examples)
    assert n == 24 * 40
    assert trained_top1 > untrained_top1 + 0.05, (trained_top1, untrained_top1)


def test_select_draft_vocab_ties_by_id() -> None:
    tokens = torch.tensor([5, 5, 3, 3, 9, 1, 9, 5])
    assert select_draft_vocab(tokens, 2, 10).tolist() == [3, 5]  # 5 x3, then 3 and 9 x2
    assert select_draft_vocab(tokens, 4, 10).tolist() == [1, 3, 5, 9]
    assert select_draft_vocab(torch.tensor([7, 7]), 3, 10).tolist() == [0, 1, 7]
    with pytest.raises(ValueError, match="draft vocab size"):
        select_draft_vocab(tokens, 11, 10)


def test_collate_aligns_inputs_and_targets() -> None:
    feats = torch.arange(5, dtype=torch.float32)[:, None].repeat(1, 3)
    example = Example([10, 11, 12, 13, 14], prompt_len=3, features=feats)
    t2d = torch.full((20,), -1, dtype=torch.int64)
    t2d[[12, 14]] = torch.tensor([0, 1])  # 13 is outside the draft vocabulary
    batch = collate([example], t2d, loss_on_prompt=False, dtype=torch.float32)
    assert batch.input_ids.tolist() == [[11, 12, 13, 14]]
    assert batch.hidden_in[0, :, 0].tolist() == [0, 1, 2, 3]
    assert batch.target_hidden[0, :, 0].tolist() == [1, 2, 3, 4]
    assert batch.target_tokens[0, :3].tolist() == [12, 13, 14]
    # position 0 predicts the prompt's last token (12): left out; 1 -> 13, 2 -> 14
    assert batch.mask.tolist() == [[False, True, True, False]]
    assert batch.draft_targets.tolist() == [[IGNORE, IGNORE, 1, IGNORE]]
    with_prompt = collate([example], t2d, loss_on_prompt=True, dtype=torch.float32)
    assert with_prompt.mask.tolist() == [[True, True, True, False]]
    assert with_prompt.draft_targets.tolist() == [[0, IGNORE, 1, IGNORE]]


def test_read_prompts(tmp_path: Path) -> None:
    txt = tmp_path / "p.txt"
    txt.write_text("hello there\n\n  \nsecond prompt\n")
    assert read_prompts(txt) == ["hello there", "second prompt"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"prompt": "b c"}\n')
    assert read_prompts(jsonl) == ["a", "b c"]
    jsonl.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: expected an object"):
        read_prompts(jsonl)
    other = tmp_path / "p.json"
    other.write_text("[]")
    with pytest.raises(ValueError, match=r"\.txt .* or \.jsonl"):
        read_prompts(other)
    with pytest.raises(FileNotFoundError, match="not found"):
        read_prompts(tmp_path / "missing.txt")


def test_cli(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"prompt number {i}: tell me something" for i in range(6)))
    out = tmp_path / "cli_head"
    code = main([
        "--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(out),
        "--seed", "1", "--max-new-tokens", "6", "--draft-vocab", "32", "--epochs", "2",
        "--lr", "1e-3", "--chat", "--ignore-eos", "--save-dtype", "bfloat16", "--threads", "1",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "epoch 2/2" in printed and "held-out top-1" in printed
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].shape == (32,)
    report = json.loads((out / "train_report.json").read_text())
    assert report["generated_tokens"] == 6 * 6 and report["num_sequences"] == 6
