"""Trimming an export's draft vocabulary: the most frequent ids stay, every kept logit is the source's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_drafter_export import trained_run  # noqa: F401  (module fixture: a 2-step trained tiny drafter)

from eaglenest.cli import main
from eaglenest.contract import ContractError
from eaglenest.drafter.export import MANIFEST, export_drafter, load_drafter
from eaglenest.drafter.trim import token_counts, trim_export
from eaglenest.drafter.vocab import count_tokens, loss_tokens


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):  # noqa: F811
    return export_drafter(trained_run, tmp_path_factory.mktemp("trim") / "sglang")


def counts_of(drafter_store) -> np.ndarray:
    return count_tokens(loss_tokens(drafter_store), 512)


def test_trimmed_export_keeps_the_most_frequent_ids_and_their_logits(exported, tmp_path, tiny_model_dir,
                                                                     drafter_store):
    counts = counts_of(drafter_store)
    src = load_file(str(exported / "model.safetensors"))
    src_ids = (src["d2t"] + torch.arange(src["d2t"].numel())).tolist()  # 150 target ids, ascending
    report = trim_export(exported, tmp_path / "t40", size=40, counts=counts)
    out = load_file(str(report.out_dir / "model.safetensors"))
    ids = (out["d2t"] + torch.arange(40)).tolist()
    # brute force: the 40 of the source's ids with the highest counts, ties to the smaller id
    expect = sorted(sorted(src_ids, key=lambda t: (-counts[t], t))[:40])
    assert ids == expect and out["t2d"].nonzero().flatten().tolist() == expect
    rows = [src_ids.index(t) for t in ids]
    assert torch.equal(out["lm_head.weight"], src["lm_head.weight"][rows])
    assert all(torch.equal(out[k], src[k]) for k in src if k not in ("lm_head.weight", "d2t", "t2d"))
    # a regular export: the loader checks its sha256 and shape, and the trimmed drafter's logits are the source's
    # at the kept ids for the same input
    a = load_drafter(exported, target_dir=tiny_model_dir).model
    b = load_drafter(report.out_dir, target_dir=tiny_model_dir).model
    assert b.config.draft_vocab_size == 40 and json.loads((report.out_dir / "config.json").read_text())[
        "draft_vocab_size"] == 40
    h = torch.randn(3, a.config.hidden_size)
    assert torch.allclose(b.lm_head(h), a.lm_head(h)[:, rows])
    total = counts.sum()
    assert report.coverage == pytest.approx(counts[expect].sum() / total)
    assert report.coverage_before == pytest.approx(counts[src_ids].sum() / total)
    assert json.loads((report.out_dir / MANIFEST).read_text())["training"]["trimmed"]["draft_vocab"] == 40


def test_trim_refuses_bad_sizes_and_counts(exported, tmp_path, drafter_store):
    counts = counts_of(drafter_store)
    with pytest.raises(ContractError, match="has 150 tokens; trimming needs a smaller size, got 150"):
        trim_export(exported, tmp_path / "a", size=150, counts=counts)
    with pytest.raises(ContractError, match=r"must be in 1\.\.150"):
        trim_export(exported, tmp_path / "b", size=0, counts=counts)
    with pytest.raises(ContractError, match="token counts cover 100 ids; the target vocabulary has 512"):
        trim_export(exported, tmp_path / "c", size=10, counts=counts[:100])
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_counts_from_answers_file_and_its_errors(tmp_path):
    good = tmp_path / "answers.jsonl"
    good.write_text('{"sample_id": "a", "output_ids": [5, 7, 7]}\n\n{"sample_id": "b", "output_ids": []}\n'
                    '{"sample_id": "c", "output_ids": [7]}\n')
    counts = token_counts(good, 16)
    assert counts[7] == 3 and counts[5] == 1 and counts.sum() == 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"output_ids": [1]}\n{"text": "no ids"}\n')
    with pytest.raises(ContractError, match=r"bad.jsonl:2: not a JSON object with a list of output_ids"):
        token_counts(bad, 16)
    with pytest.raises(ContractError, match="outside the target vocabulary"):
        token_counts(good, 6)


def test_cli_trims_with_counts_from_answers(exported, tmp_path, tiny_model_dir, capsys):
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"output_ids": [i % 97] * (i % 5 + 1)}) + "\n" for i in range(300)))
    assert main(["trim-vocab", str(exported), str(tmp_path / "t"), "--size", "64", "--counts-from",
                 str(answers)]) in (0, None)
    report = json.loads(capsys.readouterr().out)
    assert report["size"] == 64 and report["size_before"] == 150
    assert load_drafter(tmp_path / "t", target_dir=tiny_model_dir).model.config.draft_vocab_size == 64
    assert main(["trim-vocab", str(tmp_path), str(tmp_path / "u"), "--size", "8", "--counts-from",
                 str(answers)]) == 2
    assert "no eaglenest.json; trim-vocab takes an eaglenest export" in capsys.readouterr().err


def test_counts_from_an_extraction_folder_are_its_loss_masked_tokens(tmp_path):
    from eaglenest.store.extraction import ExtractionStore
    from eaglenest.testing.fake_store import make_extraction

    make_extraction(tmp_path / "ext", [12, 7, 20])
    store = ExtractionStore(tmp_path / "ext")
    masked = np.concatenate([store[i].input_ids[store[i].loss_mask].numpy() for i in range(len(store))])
    vocab = int(masked.max()) + 1
    counts = token_counts(tmp_path / "ext", vocab)
    assert counts.sum() == masked.size > 0 and np.array_equal(counts, np.bincount(masked, minlength=vocab))


def test_a_speculators_export_trims_to_a_speculators_export(trained_run, tmp_path, tiny_model_dir,  # noqa: F811
                                                            drafter_store):
    src = export_drafter(trained_run, tmp_path / "vllm", fmt="speculators", speculative_tokens=5)
    out = trim_export(src, tmp_path / "t", size=30, counts=counts_of(drafter_store)).out_dir
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 30
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert any(k.startswith("layers.0.") for k in load_file(str(out / "model.safetensors")))
    assert load_drafter(out, target_dir=tiny_model_dir).model.config.draft_vocab_size == 30
