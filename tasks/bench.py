"""Prefect tasks for the speculative-decoding benchmark: thin shells over ``eaglenest.speculative.bench``.

- Nothing is cached: a benchmark is a measurement, and a cached number would hide a regression.
- ``live_grid`` retries once, only for what a relaunch can fix (the server never became ready, or
  every request of a level failed); a gate miss is never retried.
- ``publish_report`` writes report.json / report.md / PNGs and the same content as artifacts
  (a table per concurrency, the Markdown summary, and both plots as images).
- ``check_gate`` fails the task (hence the flow) with :class:`~eaglenest.speculative.report.GateFailed`
  whose message says the speedup, the threshold and what to do.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eaglenest.engines.pool import LaunchError, end_recorded_servers
from eaglenest.speculative import bench
from eaglenest.speculative.live import ServerResult
from eaglenest.speculative.loadgen import BenchError
from eaglenest.speculative.report import BenchReport, GateResult, markdown_table, require_gate, write_report


def _retry_if_relaunch_helps(task, task_run, state) -> bool:
    try:
        state.result()
    except (LaunchError, BenchError):
        return True
    except Exception:
        return False
    return False


@task(name="bench-prompts", cache_policy=NO_CACHE)
def load_prompts(cfg: bench.BenchConfig) -> bench.Prompts:
    p = bench.prepare_prompts(cfg)
    get_run_logger().info("prompt set %s: %d prompts (%s)", p.name, len(p.token_ids), p.source)
    return p


@task(name="bench-offline-accept-length", cache_policy=NO_CACHE)
def offline_accept_length(cfg: bench.BenchConfig) -> dict[str, Any] | None:
    return bench.offline_step(cfg)


@task(name="bench-live-grid", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      retry_condition_fn=_retry_if_relaunch_helps)
def live_grid(cfg: bench.BenchConfig, prompts: bench.Prompts) -> tuple[ServerResult, ServerResult]:
    logger = get_run_logger()

    def progress(name, lv) -> None:
        logger.info("%s c=%d: %.1f tok/s, p50 %.2fs, accept length %s, errors %d", name, lv.concurrency,
                    lv.output_tok_s, lv.latency_p50_s, lv.accept_length, lv.errors)

    try:
        return bench.live_step(cfg, prompts, progress=progress)
    finally:
        end_recorded_servers(bench.pidfile(cfg))  # normally nothing is left: bench_server stops each server


def teardown(cfg: bench.BenchConfig) -> int:
    """End server process groups a crashed run left behind (flow on_failure / on_crashed hooks)."""
    return end_recorded_servers(bench.pidfile(cfg))


@task(name="bench-report", cache_policy=NO_CACHE)
def publish_report(cfg: bench.BenchConfig, prompts: bench.Prompts, baseline: ServerResult, eagle3: ServerResult,
                   offline: dict[str, Any] | None) -> BenchReport:
    report = bench.assemble(cfg, prompts, baseline, eagle3, offline)
    paths = write_report(report, cfg.output_dir)
    rows = []
    for b in report.baseline.levels:
        e = report.level("eagle3", b.concurrency)
        rows.append({"concurrency": b.concurrency, "baseline_tok_s": round(b.output_tok_s, 2),
                     "eagle3_tok_s": round(e.output_tok_s, 2) if e else None,
                     "speedup": round(report.speedups().get(b.concurrency, 0.0), 3),
                     "accept_length": round(e.accept_length, 3) if e and e.accept_length else None,
                     "baseline_p50_s": round(b.latency_p50_s, 3),
                     "eagle3_p50_s": round(e.latency_p50_s, 3) if e else None,
                     "errors": b.errors + (e.errors if e else 0)})
    create_table_artifact(rows, key="spec-bench-grid", description=f"baseline vs EAGLE3 ({report.prompt_set})")
    files = "\n".join(f"- `{p}`" for p in paths.values())
    create_markdown_artifact(markdown_table(report) + "\nFiles:\n" + files, key="spec-bench-report")
    for name in ("tok_s", "accept_length"):
        if name in paths:
            data = base64.b64encode(Path(paths[name]).read_bytes()).decode()
            create_image_artifact(f"data:image/png;base64,{data}", key=f"spec-bench-{name.replace('_', '-')}",
                                  description=str(paths[name]))
    return report


@task(name="bench-gate", cache_policy=NO_CACHE)
def check_gate(cfg: bench.BenchConfig, report: BenchReport) -> GateResult:
    g = require_gate(report, target_concurrency=cfg.target_concurrency, min_speedup=cfg.min_speedup)
    get_run_logger().info(g.message)
    return g
