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


class StopAfter:
    """Test fake for the embedded engine's ``greedy_decoder``: the target's own greedy tokens, then its
    end-of-turn after ``k`` of them (a tiny random model never ends an answer by itself)."""

    def __init__(self, runner, k: int = 6, delay_s: float = 0.0) -> None:
        self.runner, self.k, self.delay_s = runner, k, delay_s

    def generate_greedy(self, input_ids, *, max_new_tokens, ignore_eos):
        import time

        from eaglenest.engines.runtime import Generation

        time.sleep(self.delay_s)
        g = self.runner.generate(input_ids, max_new_tokens=min(max_new_tokens, self.k), ignore_eos=True)
        if max_new_tokens <= self.k:
            return g
        return Generation([*g.output_ids, self.runner.tokenizer.eos_token_id], "stop", None, g.prefill_s, g.decode_s)


def record_rids(engine) -> list[str]:
    """Every rid the engine is asked for, in order (wraps its submit)."""
    rids: list[str] = []
    submit = engine.submit

    def recording(work):
        rids.append(work.rid)
        return submit(work)

    engine.submit = recording
    return rids
