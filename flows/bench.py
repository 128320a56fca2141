"""The ``bench`` flow: prompts -> (offline accept length) -> baseline & EAGLE3 servers at each concurrency
-> report + artifacts -> gate.

Composition only (each step is a task in ``tasks/bench.py`` over ``eaglenest.speculative.bench``). The
parameter is :class:`eaglenest.speculative.bench.BenchConfig` (a form in the UI). The run ends Failed with
GateFailed's message when EAGLE3's speedup at ``target_concurrency`` is below ``min_speedup``; the
report and plots are written (and published as artifacts) before the gate is judged.
"""

from __future__ import annotations

from prefect import flow

from eaglenest.speculative.bench import BenchConfig
from tasks import bench as t


def _teardown(flow_obj, flow_run, state) -> None:
    """on_failure / on_crashed: end server process groups this run may have left (idempotent)."""
    raw = (flow_run.parameters or {}).get("config")
    if raw is not None:
        t.teardown(raw if isinstance(raw, BenchConfig) else BenchConfig.model_validate(raw))


@flow(name="bench", on_failure=[_teardown], on_crashed=[_teardown], validate_parameters=True)
def bench(config: BenchConfig) -> dict:
    prompts = t.load_prompts(config)
    offline = t.offline_accept_length(config)
    baseline, eagle3 = t.live_grid(config, prompts)
    report = t.publish_report(config, prompts, baseline, eagle3, offline)
    gate = t.check_gate(config, report)
    return {"speedups": report.speedups(), "accept_length": report.live_accept_length(), "gate": gate.message,
            "output_dir": config.output_dir}
