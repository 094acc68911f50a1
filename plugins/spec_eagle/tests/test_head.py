"""The EAGLE head: paged forward == dense forward, save/load, load errors, features vs HF."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from plugserve.attention.base import AttentionContext
from plugserve.attention.torch_native import TorchNativeBackend
from plugserve.model import load_model
from plugserve.model.llama import CausalLM
from plugserve.pools.kv_pool import KVPool
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve_spec_eagle.features import pack_batches, target_hidden_states
from plugserve_spec_eagle.head import (
    EagleHead,
    EagleHeadConfig,
    EagleHeadLoadError,
    load_head,
    save_head,
)

LENGTHS = (7, 12)



@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> CausalLM:
    model = load_model(tiny_model_dir, dtype=torch.float32, device="cpu").model
    model.requires_grad_(False)
    return model


def make_head(target: CausalLM, draft_vocab: int | None = None, seed: int = 0) -> EagleHead:
    # A wider init than the default so the layer's attention matters in the comparisons.
    config = dataclasses.replace(
        EagleHeadConfig.from_target(target.arch, draft_vocab), initializer_range=0.2
    )
    head = EagleHead(config, target, dtype=torch.float32, device="cpu")
    head.init_weights(seed)
    if draft_vocab is not None:
        head.set_d2t(torch.randperm(target.arch.vocab_size)[:draft_vocab].sort().values)
    return head


def random_inputs(
    target: CausalLM, lengths: tuple[int, ...], seed: int = 1
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, target.arch.vocab_size, (n,), generator=gen) for n in lengths]
    hidden = [torch.randn(n, target.arch.hidden_size, generator=gen) for n in lengths]
    return ids, hidden


def paged_forward(
    head: EagleHead, ids: list[torch.Tensor], hidden: list[torch.Tensor], *, page_size: int,
    chunks: int,
) -> list[torch.Tensor]:
    """Run the sequences through the head over a draft pool, as `chunks` successive extends;
    return each sequence's output hidden rows."""
    layer = head.attention_layer
    num_reqs = len(ids)
    pages_per_req = math.ceil(max(len(x) for x in ids) / page_size)
    pool = KVPool(num_pages=num_reqs * pages_per_req, page_size=page_size,
                  layer_ids=[layer.layer_id], num_kv_heads=layer.num_kv_heads,
                  head_dim=layer.head_dim, dtype=torch.float32, device="cpu")
    # Request i owns pages i+1, i+1+num_reqs, ... (interleaved; page 0 is padding).
    pos = torch.arange(pages_per_req * page_size)
    pages = 1 + torch.arange(num_reqs)[:, None] + (pos // page_size)[None, :] * num_reqs
    req_to_token = (pages * page_size + pos % page_size).to(torch.int64)
    backend = TorchNativeBackend(AttentionContext(
        num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
        page_size=page_size, max_batch_size=num_reqs, context_len=pages_per_req * page_size,
        dtype=torch.float32, device=torch.device("cpu"),
    ))
    outputs: list[list[torch.Tensor]] = [[] for _ in ids]
    done = [0] * num_reqs
    for c in range(chunks):
        ends = [len(x) * (c + 1) // chunks for x in ids]
        prefix, seq = list(done), ends
        ext = [e - p for p, e in zip(prefix, seq, strict=True)]
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND,
            input_ids=torch.cat([x[p:e] for x, p, e in zip(ids, prefix, seq, strict=True)]),
            positions=torch.cat([torch.arange(p, e) for p, e in zip(prefix, seq, strict=True)]),
            out_cache_loc=torch.cat(
                [req_to_token[i, p:e] for i, (p, e) in enumerate(zip(prefix, seq, strict=True))]
            ),
            req_pool_indices=torch.arange(num_reqs),
            seq_lens=torch.tensor(seq), extend_prefix_lens=torch.tensor(prefix),
            extend_seq_lens=torch.tensor(ext), req_to_token=req_to_token, kv_pool=pool,
            seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext,
        )
        backend.init_forward_metadata(fb)
        hidden_in = torch.cat([h[p:e] for h, p, e in zip(hidden, prefix, seq, strict=True)])
        with torch.no_grad():
            out = head(fb, backend, hidden_in)
        assert out.hidden.shape == (sum(ext), head.config.hidden_size)
        for i, rows in enumerate(out.hidden.split(ext)):
            outputs[i].append(rows)
        done = seq
    return [torch.cat(parts) for parts in outputs]


def dense_forward(
    head: EagleHead, ids: list[torch.Tensor], hidden: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Right-padded dense forward; each sequence's real rows (hidden, logits)."""
    seq_len = max(len(x) for x in ids)
    batch_ids = torch.zeros(len(ids), seq_len, dtype=torch.int64)
    batch_hidden = torch.zeros(len(ids), seq_len, head.config.hidden_size)
    for i, (x, h) in enumerate(zip(ids, hidden, strict=True)):
        batch_ids[i, : len(x)] = x
        batch_hidden[i, : len(x)] = h
    with torch.no_grad():
        out_hidden, logits = head.forward_dense(batch_ids, batch_hidden)
    return (
        [out_hidden[i, : len(x)] for i, x in enumerate(ids)],
        [logits[i, : len(x)] for i, x in enumerate(ids)],
    )


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunks", [1, 2])
def test_paged_forward_matches_dense(target: CausalLM, page_size: int, chunks: int) -> None:
    head = make_head(target)
    ids, hidden = random_inputs(target, LENGTHS)
    paged = paged_forward(head, ids, hidden, page_size=page_size, chunks=chunks)
    dense, _ = dense_forward(head, ids, hidden)
    for p, d in zip(paged, dense, strict=True):
        torch.testing.assert_close(p, d, atol=1e-5, rtol=1e-5)
    # The attention matters: a lone sequence's last rows change when its prefix changes.
    other_hidden = [h.clone() for h in hidden]
    other_hidden[1][0] += 1.0
    moved, _ = dense_forward(head, ids, other_hidden)
    assert (moved[1][-1] - dense[1][-1]).abs().max() > 1e-3
    torch.testing.assert_close(moved[0], dense[0])  # and sequences do not leak into each other


def test_logits_are_target_lm_head_over_draft_vocab(target: CausalLM) -> None:
    head = make_head(target, draft_vocab=50)
    ids, hidden = random_inputs(target, (9,))
    out_hidden, logits = dense_forward(head, ids, hidden)
    assert logits[0].shape == (9, 50) and logits[0].dtype == torch.float32
    full = target.compute_logits(target.final_norm(out_hidden[0]))
    torch.testing.assert_close(logits[0], full[:, head.d2t], atol=1e-5, rtol=1e-5)
    draft_ids = logits[0].argmax(-1)
    assert torch.equal(head.to_target_ids(draft_ids), head.d2t[draft_ids])
    assert bool((head.to_target_ids(draft_ids) < target.arch.vocab_size).all())


def test_head_owns_only_its_parameters(target: CausalLM) -> None:
    head = make_head(target)
    names = set(head.state_dict())
    assert "d2t" in names and "fc.weight" in names
    assert not any("embed" in n or "lm_head" in n or "final_norm" in n for n in names)
    assert head.fc.weight.shape == (target.arch.hidden_size, 2 * target.arch.hidden_size)
    assert head.attention_layer.layer_id == 0


@pytest.mark.parametrize("save_dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(target: CausalLM, tmp_path: Path, save_dtype: str) -> None:
    head = make_head(target, draft_vocab=40)
    folder = save_head(head, tmp_path / "head", dtype=save_dtype)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((folder / "config.json").read_text())["plugserve_head"] == "eagle"
    loaded = load_head(folder, target, dtype=torch.float32, device="cpu")
    assert loaded.config == head.config
    assert torch.equal(loaded.d2t, head.d2t)
    if save_dtype == "bfloat16":  # what was saved is the bf16-rounded head
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    ids, hidden = random_inputs(target, LENGTHS)
    expected = dense_forward(head, ids, hidden)
    got = dense_forward(loaded, ids, hidden)
    for e, g in zip(expected[0] + expected[1], got[0] + got[1], strict=True):
        assert torch.equal(e, g)


def test_load_errors(target: CausalLM, tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(EagleHeadLoadError, match="does not exist"):
        load_head(tmp_path / "nowhere", target)
    # The target model's own folder has a config.json, but not a head's.
    with pytest.raises(EagleHeadLoadError, match=r"not a plugserve EAGLE head.*'eagle'"):
        load_head(tiny_model_dir, target)
    folder = save_head(make_head(target), tmp_path / "head", dtype="float32")
    config_path = folder / "config.json"
    good = json.loads(config_path.read_text())

    config_path.write_text(json.dumps({**good, "hidden_size": 32}))
    with pytest.raises(EagleHeadLoadError, match="hidden_size 32 but the target has 64"):
        load_head(folder, target)
    config_path.write_text(json.dumps({**good, "target_vocab_size": 99, "draft_vocab_size": 99}))
    with pytest.raises(EagleHeadLoadError, match=f"vocab size 99 but the target has "
                                                 f"{target.arch.vocab_size}"):
        load_head(folder, target)
    config_path.write_text(json.dumps({**good, "intermediate_size": 32}))
    shapes = r"gate_up_proj\.weight has shape \[256, 64\].*needs \[64, 64\]"
    with pytest.raises(EagleHeadLoadError, match=shapes):
        load_head(folder, target)
    config_path.write_text(json.dumps({k: v for k, v in good.items() if k != "head_dim"}))
    with pytest.raises(EagleHeadLoadError, match=r"missing field.*head_dim"):
        load_head(folder, target)
    config_path.write_text("{not json")
    with pytest.raises(EagleHeadLoadError, match="cannot read JSON"):
        load_head(folder, target)
    config_path.unlink()
    with pytest.raises(EagleHeadLoadError, match=r"needs a config\.json"):
        load_head(folder, target)
    config_path.write_text(json.dumps(good))
    (folder / "model.safetensors").unlink()
    with pytest.raises(EagleHeadLoadError, match=r"needs model\.safetensors"):
        load_head(folder, target)


def test_pack_batches() -> None:
    assert pack_batches([3, 4, 2, 9, 1], 7) == [[0, 1], [2], [3], [4]]
    assert pack_batches([5], 1) == [[0]]


def test_features_match_hf(target: CausalLM, tiny_model_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf.eval()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 11, 8)]
    # batch_tokens 16 packs [5, 11] together and 8 alone.
    ours = target_hidden_states(target, seqs, batch_tokens=16)
    assert [h.shape for h in ours] == [(n, target.arch.hidden_size) for n in (5, 11, 8)]
    for seq, feats in zip(seqs, ours, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(target.final_norm(feats), ref, atol=1e-5, rtol=1e-4)
        # what we return is the state before the final norm
        assert (feats - ref).abs().max() > 1e-2
