"""Running an extraction: its servers, the per-batch steps, and :func:`run_extraction` end to end.

Owns the order of engine work for one run: connect (preflight every server), then per batch
regenerate (optional) -> prefill (relaunch dead servers and resend retryable failures, bounded) ->
validate (in a background thread, overlapping the next batch's prefill) -> ledger; invalid shards
re-queued once at the end. The Prefect tasks in ``tasks/extract.py`` wrap these same functions.

Invariants: no request for a sample whose shard is already present (validation decides it);
terminal failures are never resent within a run; every server this run launched is stopped on
every exit path (``with ServerPool``); nothing here imports Prefect.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from eaglenest import contract
from eaglenest.data.chat import ChatEncoder, Skipped
from eaglenest.data.samples import Sample
from eaglenest.extraction.config import ExtractParams
from eaglenest.extraction.prefill import ClientConfig, Failure, PrefillProgress, prefill
from eaglenest.extraction.regenerate import RegenConfig, regenerate
from eaglenest.extraction.state import (
    ConfigChanged,
    Counts,
    Extraction,
    append_regenerated,
    open_extraction,
    plan,
    prepare,
    write_report,
)
from eaglenest.extraction.validate import Expectation, ValidateConfig, load_lm_head, quarantine, validate_batch
from eaglenest.servers import LaunchSpec, PreflightError, ServerPool, preflight


@dataclass(frozen=True, slots=True)
class Progress:
    total: int
    """Samples this run set out to finish."""
    answered: int
    failed: int
    validated: int
    tokens: int
    requests: int
    elapsed_s: float


@dataclass
class RunContext:
    """What a run learned from its servers, shared by its steps (in-process, never serialized)."""

    pool: ServerPool
    expect: Expectation
    capture_dirs: tuple[str, ...]
    max_prompt_tokens: int
    client_config: ClientConfig
    validate_config: ValidateConfig
    transport: httpx.AsyncBaseTransport | None = None
    encoder: ChatEncoder | None = None
    lm_head: object | None = None


@dataclass
class PrefillStep:
    to_validate: list[Sample] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)


@dataclass
class ValidateStep:
    requeue: list[Sample] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)


# ------------------------------------------------------------------------------ servers
def _tp_size(args: Sequence[str]) -> int:
    text = " ".join(args)
    m = re.search(r"--(?:tp-size|tensor-parallel-size|tp)[ =](\d+)", text)
    return int(m.group(1)) if m else 1


def launch_specs(ext: Extraction) -> list[LaunchSpec]:
    """How to start each of ``num_servers`` servers for this extraction (embedded or sglang)."""
    from eaglenest.engines.launcher import ServerProcess, embedded_command

    p = ext.params

    def embedded(i: int) -> LaunchSpec:
        def make(port: int) -> ServerProcess:
            cmd = embedded_command(model=str(ext.model_dir), port=port, capture_dir=str(ext.capture_dir),
                                   aux_layer_ids=ext.aux_layer_ids, dtype=p.dtype,
                                   extra=["--max-batch-size", str(p.embedded_max_batch_size)])
            return ServerProcess(cmd=cmd, url=f"http://127.0.0.1:{port}", log_path=ext.path(f"logs/server-{i}.log"))
        return LaunchSpec(f"embedded-{i}", make)

    def sglang(i: int) -> LaunchSpec:
        def make(port: int) -> ServerProcess:
            from eaglenest.engines import sglang_launcher

            args = list(p.sglang_args)
            if p.num_servers > 1 and "--base-gpu-id" not in args:  # data parallel: one GPU set per server
                args += ["--base-gpu-id", str(i * _tp_size(args))]
            cmd, env = sglang_launcher.build_command(
                model_dir=ext.model_dir, capture_dir=ext.capture_dir, host="127.0.0.1", port=port,
                aux_layer_ids=list(ext.aux_layer_ids), sglang_args=args)
            return ServerProcess(cmd=list(cmd), url=f"http://127.0.0.1:{port}",
                                 log_path=ext.path(f"logs/server-{i}.log"), env=dict(env or {}))
        return LaunchSpec(f"sglang-{i}", make)

    make_spec = embedded if p.engine == "embedded" else sglang
    return [make_spec(i) for i in range(p.num_servers)]


def make_pool(ext: Extraction) -> ServerPool:
    p = ext.params
    if p.server_urls:
        return ServerPool(urls_given=p.server_urls, launch_timeout_s=p.launch_timeout_s)
    return ServerPool(specs=launch_specs(ext), launch_timeout_s=p.launch_timeout_s,
                      max_relaunches=max(1, p.max_relaunch_rounds) * 2, record_path=ext.path("servers.json"))


def connect(ext: Extraction, pool: ServerPool, *, transport: httpx.AsyncBaseTransport | None = None) -> RunContext:
    """Preflight the servers against the run and the extraction's pinned provenance."""
    p = ext.params
    pf = preflight(pool.urls, aux_layer_ids=ext.aux_layer_ids, require_capture_block=p.engine == "embedded",
                   hidden_size=ext.hidden_size)
    fp = ext.fingerprint
    expect = Expectation(aux_layer_ids=ext.aux_layer_ids, hidden_size=ext.hidden_size, num_layers=ext.num_layers,
                         model_hash=fp["model_hash"], tokenizer_hash=fp["tokenizer_hash"],
                         chat_template_hash=fp["chat_template_hash"])
    if pf.provenance is not None:
        diff = expect.mismatches(pf.provenance)
        if diff:
            raise PreflightError(f"the servers do not serve the run's model/tokenizer/template as tokenized here: "
                                 f"{'; '.join(diff)}")
    pinned_path = ext.path("provenance.json")
    pinned = contract.Provenance.from_json(pinned_path.read_text()) if pinned_path.is_file() else None
    if pinned is not None and pf.provenance is not None and pinned.mismatches(pf.provenance):
        raise ConfigChanged(f"extraction {ext.id} was captured with other numerics "
                            f"({', '.join(pinned.mismatches(pf.provenance))} differ from {pinned_path}); "
                            "use another extraction_id for this server setup")
    if pf.provenance is not None and pinned is None:
        contract.atomic_write_bytes(pinned_path, pf.provenance.to_json().encode())
    expect = expect.pinned(pf.provenance or pinned) if (pf.provenance or pinned) else expect
    limit = ext.token_limit
    if pf.context_length:
        limit = min(limit, pf.context_length - max(1, p.context_headroom))
    dirs = [*pf.capture_dirs, *([p.server_capture_dir] if p.server_capture_dir else [])]
    client = ClientConfig(concurrency=p.concurrency, timeout_s=p.request_timeout_s, max_attempts=p.max_attempts,
                          backoff_s=p.backoff_s, backoff_max_s=max(p.backoff_s, 15.0))
    ctx = RunContext(pool=pool, expect=expect, capture_dirs=tuple(dirs), max_prompt_tokens=limit,
                     client_config=client, validate_config=ValidateConfig(
                         shard_wait_s=p.shard_wait_s, min_argmax_agreement=p.min_argmax_agreement),
                     transport=transport)
    if p.regeneration.enabled:
        ctx.encoder = ChatEncoder(ext.model_dir)
        ctx.lm_head = load_lm_head(ext.model_dir)
    return ctx


# ------------------------------------------------------------------------------ steps
def _problem(sample_id: str, stage: str, kind: str, message: str) -> dict:
    return {"sample_id": sample_id, "stage": stage, "kind": kind, "message": message}


def regenerate_batch(ext: Extraction, ctx: RunContext, batch: Sequence[Sample]) -> tuple[list[Sample], Counts]:
    """Rebuild not-yet-regenerated samples from the target's answers; persists them before returning."""
    counts = Counts()
    todo = [s for s in batch if not s.regenerated]
    ready = [s for s in batch if s.regenerated]
    if not todo:
        return ready, counts
    r = ext.params.regeneration
    res = regenerate(todo, ctx.pool.urls, ctx.encoder, max_tokens=ctx.max_prompt_tokens,
                     config=RegenConfig(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                        seed=r.seed),
                     client_config=ctx.client_config, transport=ctx.transport)
    append_regenerated(ext, res.samples, res.skipped)
    counts.requests, counts.retries = res.stats.requests, res.stats.retries
    counts.regenerated = len(res.samples)  # its skips are persisted and reported from regenerated.jsonl
    counts.failed = len(res.failures)
    counts.problems += [_problem(sid, "regenerate", f.reason, f.message) for sid, f in res.failures.items()]
    return ready + res.samples, counts


def prefill_batch(ext: Extraction, ctx: RunContext, batch: Sequence[Sample], *,
                  on_progress: Callable[[PrefillProgress], None] | None = None) -> PrefillStep:
    """Send the batch's samples that have no shard yet; relaunch and resend retryable failures (bounded)."""
    step, t0 = PrefillStep(), time.perf_counter()
    names = {s.sample_id: contract.shard_filename(s.sample_id) for s in batch}
    dirs = [ext.capture_dir, *map(Path, ctx.capture_dirs)]
    pending = []
    for s in batch:
        if s.num_tokens > ctx.max_prompt_tokens:
            step.counts.skipped += 1
            step.counts.problems.append(_problem(s.sample_id, "prefill", "too_long",
                                                 f"{s.num_tokens} tokens > server limit {ctx.max_prompt_tokens}"))
        elif any((d / names[s.sample_id]).is_file() for d in dirs):
            step.to_validate.append(s)  # answered before (e.g. a killed run): validation decides
            step.counts.reused_shards += 1
        else:
            pending.append(s)
    failures: dict[str, Failure] = {}
    for round_ in range(ext.params.max_relaunch_rounds + 1):
        if not pending:
            break
        res = prefill(pending, ctx.pool.urls, config=ctx.client_config, transport=ctx.transport,
                      on_progress=on_progress)
        step.counts.requests += res.stats.requests
        step.counts.retries += res.stats.retries
        step.counts.tokens += res.tokens
        step.to_validate += [s for s in pending if s.sample_id in res.answers]
        failures.update({k: f for k, f in res.failures.items() if f.kind == "terminal"})
        retry = [s for s in pending if s.sample_id in res.failures and res.failures[s.sample_id].kind == "retryable"]
        if retry and round_ < ext.params.max_relaunch_rounds and ctx.pool.revive() > 0:
            # a dying server may have finished work whose answer never arrived: validate, do not resend
            done = [s for s in retry if any((d / names[s.sample_id]).is_file() for d in dirs)]
            step.to_validate += done
            step.counts.reused_shards += len(done)
            pending = [s for s in retry if s not in done]
            continue
        failures.update({s.sample_id: res.failures[s.sample_id] for s in retry})
        break
    for sid, f in failures.items():  # an answer that broke the contract must not leave its shard behind
        path = next((d / names[sid] for d in dirs if (d / names[sid]).is_file()), None)
        if f.reason == "contract" and path is not None:
            quarantine(ext.dir, path, sid, f.message, "contract")
    step.counts.failed = len(failures)
    step.counts.problems += [_problem(k, "prefill", f.reason, f.message) for k, f in failures.items()]
    step.counts.prefill_s = time.perf_counter() - t0
    return step


def validate_step(ext: Extraction, ctx: RunContext, samples: Sequence[Sample], *,
                  allow_requeue: bool = True) -> ValidateStep:
    """Validate shards, append the valid ones to the ledger, quarantine the rest (re-queue once)."""
    step, t0 = ValidateStep(), time.perf_counter()
    if not samples:
        return step
    res = validate_batch(samples, extraction_dir=ext.dir, expect=ctx.expect, server_capture_dirs=ctx.capture_dirs,
                         config=ctx.validate_config, lm_head=ctx.lm_head)
    ext.ledger.append(res.entries)
    if res.pinned is not None:
        pinned = ext.path("provenance.json")
        if not pinned.is_file():
            contract.atomic_write_bytes(pinned, res.pinned.to_json().encode())
        ctx.expect = ctx.expect.pinned(res.pinned)
    by_id = {s.sample_id: s for s in samples}
    c = step.counts
    c.validated, c.outliers = len(res.entries), res.outliers
    for e in res.entries:
        if "argmax_agreement" in e.stats:
            c.argmax_hits += e.stats["argmax_agreement"] * e.stats["argmax_positions"]
            c.argmax_positions += e.stats["argmax_positions"]
    for inv in res.invalid:
        if inv.requeue and allow_requeue:
            step.requeue.append(by_id[inv.sample_id])
        else:
            c.invalid += 1
            c.problems.append(_problem(inv.sample_id, "validate", inv.kind, inv.reason))
    c.requeued = len(step.requeue)
    c.validate_s = time.perf_counter() - t0
    return step


# ------------------------------------------------------------------------------ end to end
def run_extraction(params: ExtractParams, *, on_progress: Callable[[Progress], None] | None = None,
                   pool: ServerPool | None = None, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Extract end to end (plain Python, no Prefect); returns the report (also in report.json)."""
    t0 = time.perf_counter()
    ext = open_extraction(params)
    prepared = prepare(ext)
    batches = plan(ext, prepared)
    counts = Counts()
    relaunches = launched = 0
    phases = {"prepare": time.perf_counter() - t0}
    if batches:
        total = sum(map(len, batches))
        base = {"answered": 0, "failed": 0, "tokens": 0, "requests": 0}

        def report_progress(p: PrefillProgress | None = None) -> None:
            if on_progress is not None:
                p = p or PrefillProgress(0, 0, 0, 0, 0, 0)
                on_progress(Progress(total, base["answered"] + p.done, base["failed"] + p.failed, counts.validated,
                                     base["tokens"] + p.tokens, base["requests"] + p.requests,
                                     time.perf_counter() - t0))

        def after(step: PrefillStep) -> None:
            counts.add(step.counts)
            base["answered"] += len(step.to_validate)
            base["failed"] += step.counts.failed
            base["tokens"] += step.counts.tokens
            base["requests"] += step.counts.requests

        pool = pool or make_pool(ext)
        with pool, cf.ThreadPoolExecutor(1, thread_name_prefix="validate") as validator:
            phases["launch"] = time.perf_counter() - t0 - phases["prepare"]
            ctx = connect(ext, pool, transport=transport)
            phases["connect"] = time.perf_counter() - t0 - phases["prepare"] - phases["launch"]
            requeue: list[Sample] = []
            running: cf.Future | None = None

            def collect() -> None:
                if running is not None:
                    v = running.result()
                    counts.add(v.counts)
                    requeue.extend(v.requeue)
                    report_progress()

            for batch in batches:
                if params.regeneration.enabled:
                    batch, c = regenerate_batch(ext, ctx, batch)
                    counts.add(c)
                step = prefill_batch(ext, ctx, batch, on_progress=report_progress)
                after(step)
                collect()
                running = validator.submit(validate_step, ext, ctx, step.to_validate)
            collect()
            if requeue:
                step = prefill_batch(ext, ctx, requeue, on_progress=report_progress)
                after(step)
                v = validate_step(ext, ctx, step.to_validate, allow_requeue=False)
                counts.add(v.counts)
                report_progress()
            relaunches, launched = pool.relaunches, pool.launched
    return write_report(ext, prepared, counts, wall_s=time.perf_counter() - t0, relaunches=relaunches,
                        servers_launched=launched, phases=phases)


__all__ = [
    "Progress", "RunContext", "Skipped", "connect", "launch_specs", "make_pool", "open_extraction", "plan",
    "prefill_batch", "prepare", "regenerate_batch", "run_extraction", "validate_step",
]
