"""What an extraction run did: its counts (additive over rounds and validation chunks) and ``report.json``
(totals over the extraction plus this run), written at the end of every run, also one an exception ends."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from eaglenest import contract
from eaglenest.extraction.state import Extraction, Prepared, load_regenerated, write_json


@dataclass
class Counts:
    """What one run did (additive over the loop's rounds and validation chunks)."""

    validated: int = 0
    invalid: int = 0
    failed: int = 0
    skipped: int = 0
    requeued: int = 0
    requests: int = 0
    retries: int = 0
    retry_errors: dict[str, int] = field(default_factory=dict)
    """Retried requests by what went wrong (the engine client's ``retry_errors``)."""
    reused_shards: int = 0
    """Shards already present for pending samples (validated without a request)."""
    validated_after_stop: int = 0
    """Of ``validated``: shards an interrupted run validated after stopping its servers (stop_validate_s)."""
    tokens: int = 0
    outliers: int = 0
    regenerated: int = 0
    generated_tokens: int = 0
    """Tokens the target generated this run (regeneration)."""
    replayed_answers: int = 0
    """Answers persisted by an earlier run and reused without a request."""
    turns_cut: int = 0
    """Later turns whose answer was cut or empty (dropped with the rest of their conversation)."""
    cut_kept: int = 0
    """Answers cut by max_new_tokens or the token cap, kept as the last turn of their sample."""
    prefill_s: float = 0.0
    """Seconds from the first capture request to the last capture answer (overlaps regeneration)."""
    validate_s: float = 0.0
    """Seconds spent validating (in a thread, overlapping regeneration and prefill)."""
    streaks_survived: int = 0
    """Streaks of connection failures after which the server still answered /health (it kept its work)."""
    servers_taken_out: list[str] = field(default_factory=list)
    """Per server taken out of a round: its URL and the last errors (its queued work went to the next round)."""
    argmax_hits: float = 0.0
    argmax_positions: int = 0
    problems: list[dict] = field(default_factory=list)

    def add(self, other: Counts) -> Counts:
        for k, v in asdict(other).items():
            if isinstance(v, list):
                getattr(self, k).extend(v)
            elif isinstance(v, dict):
                mine = getattr(self, k)
                for key, n in v.items():
                    mine[key] = mine.get(key, 0) + n
            else:
                setattr(self, k, getattr(self, k) + v)
        return self


def write_report(ext: Extraction, prepared: Prepared, counts: Counts, *, wall_s: float, relaunches: int = 0,
                 servers_launched: int = 0, phases: dict[str, float] | None = None,
                 rates: dict[str, float] | None = None, status: str | None = None,
                 ended_by: str | None = None, servers: dict | None = None, eval_capture: dict | None = None) -> dict:
    """report.json: totals over the extraction plus what this run did. Returns it.

    ``status``: ``complete`` / ``incomplete`` (samples pending) for a run that ended normally (the default,
    from the ledger), ``interrupted`` or ``failed`` for one that an exception ended (``ended_by`` names it).
    ``pending_detail``: of the samples not in the ledger, those with a shard (the next run validates them without
    a request) and those with a persisted regenerated answer (the next run asks only for their capture).
    ``servers``: when each launched server was ready and which failed to launch late (``run.servers``).
    ``eval_capture``: what this run's eval capture did (``run.eval_capture``; ExtractParams.eval_capture)."""
    entries = ext.ledger.entries()
    ids = {s.sample_id for s in prepared.samples}
    done = [e for sid, e in entries.items() if sid in ids]
    regenerated, regen_skipped = load_regenerated(ext) if ext.params.regeneration.enabled else ({}, {})
    all_skipped = [*prepared.skipped, *regen_skipped.values()]
    skipped: dict[str, int] = {}
    for s in all_skipped:
        skipped[s.kind] = skipped.get(s.kind, 0) + 1
    for p in counts.problems:  # longer than the servers' context (smaller than the model's): skipped, not pending
        if p["kind"] == "too_long" and p["sample_id"] not in regen_skipped:
            skipped["too_long_for_server"] = skipped.get("too_long_for_server", 0) + 1
    pending = len(prepared.samples) - len(done) - len(regen_skipped) - skipped.get("too_long_for_server", 0)
    shards = {p.name for p in contract.iter_shard_paths(ext.capture_dir)}
    waiting = [s for s in prepared.samples if s.sample_id not in entries]
    pending_detail = {  # what a re-run starts from
        "shard_written": sum(contract.shard_filename(s.sample_id) in shards for s in waiting),
        "regenerated": sum(s.sample_id in regenerated for s in waiting),
    }
    run = asdict(counts)
    run.pop("problems")
    hits, positions = run.pop("argmax_hits"), run.pop("argmax_positions")
    run["prefill_s"], run["validate_s"] = round(run["prefill_s"], 3), round(run["validate_s"], 3)
    report = {
        "extraction_id": ext.id, "dir": str(ext.dir), "samples": len(prepared.samples),
        "done": len(done), "pending": pending, "pending_detail": pending_detail,
        "skipped": skipped, "skipped_total": sum(skipped.values()),
        "bad_records": len(prepared.bad), "bad_record_examples": [asdict(b) for b in prepared.bad[:50]],
        "tokens_done": sum(e.num_tokens for e in done), "loss_tokens_done": sum(e.loss_tokens for e in done),
        "bytes_done": sum(e.bytes for e in done),
        "run": {**run, "wall_s": round(wall_s, 3), "tok_per_s": round(counts.tokens / wall_s, 1) if wall_s else 0.0,
                "relaunches": relaunches, "servers_launched": servers_launched,
                **({"servers": servers} if servers else {}),
                **({"eval_capture": eval_capture} if eval_capture else {}),
                "phases_s": {k: round(v, 3) for k, v in (phases or {}).items()},
                "rates": {k: round(v, 1) for k, v in (rates or {}).items()},
                "argmax_agreement": round(hits / positions, 4) if positions else None},
        "problems": counts.problems,
        "complete": pending == 0,
        "status": status or ("complete" if pending == 0 else "incomplete"),
        **({"ended_by": ended_by} if ended_by else {}),
    }
    write_json(ext.path("report.json"), report)
    return report
