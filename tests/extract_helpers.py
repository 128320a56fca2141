"""Helpers shared by the extraction tests (not a test module)."""

import json

from eaglenest import contract
from eaglenest.extraction.config import ExtractParams


def with_(params, **kw):
    return ExtractParams(**{**params.model_dump(), **kw})


def ledger_lines(ext_dir):
    """Parseable ledger lines (a torn line left by a crash is not an entry)."""
    out = []
    for line in (ext_dir / "ledger.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def ledger_ids(ext_dir):
    return [e["sample_id"] for e in ledger_lines(ext_dir)]


def assert_complete_and_exact(report, ext_dir):
    """Every planned sample is in the ledger exactly once, with a valid shard of the same bytes."""
    ids = ledger_ids(ext_dir)
    assert report["complete"] and report["pending"] == 0
    assert len(ids) == len(set(ids)) == report["done"] == report["samples"]
    for e in ledger_lines(ext_dir):
        data = (ext_dir / "capture" / e["shard"]).read_bytes()
        assert contract.sha256_bytes(data) == e["sha256"]
        assert contract.decode_shard(data).num_tokens == e["num_tokens"]
    assert not list((ext_dir / "capture").glob("*.tmp"))
