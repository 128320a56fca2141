"""``eaglenest bench ...``: speculative-decoding benchmarks. Thin: parses options, calls eaglenest.speculative.

Commands: ``live`` (baseline vs EAGLE3 grid + gate, embedded or SGLang), ``cpu`` (side-by-side
decoder benchmark in one process), ``offline`` (store simulation), ``prompts`` (export a prompt set
as token ids for a machine without network), ``plot`` (report files from a report.json), ``serve``
(the embedded benchmark server; what ``live --engine embedded`` launches).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from eaglenest.cli.options import model_command
from eaglenest.speculative.bench import BenchConfig

app = typer.Typer(no_args_is_help=True, help="Speculative-decoding benchmarks (EAGLE-3 vs plain decoding).")


BENCH_FLAGS = {
    "num_steps": "--steps", "num_draft_tokens": "--draft-tokens", "concurrencies": "--concurrency",
    "output_dir": "--out", "store_url": "--store", "sglang_args": "--sglang-arg",
    "baseline_sglang_args": "--baseline-sglang-arg",
    "offline_max_samples": "--max-samples",
}
"""Option names that differ from BenchConfig's field names (the benchmark's own vocabulary)."""


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="'default' or a local HF folder")] = "default",
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 30000,
    dtype: Annotated[str, typer.Option(help="auto | bfloat16 | float32")] = "auto",
    onednn: Annotated[str, typer.Option(help="onednn | no-onednn | prefill-only | prefill+verify")] = "prefill-only",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None,
    speculative_algorithm: Annotated[str | None, typer.Option(help="EAGLE3 (or unset: plain decoding)")] = None,
    speculative_draft_model_path: Annotated[str | None, typer.Option(help="exported EAGLE-3 drafter")] = None,
    speculative_num_steps: Annotated[int | None, typer.Option(help="draft depth (default: the measured best "
                                                             "shape)")] = None,
    speculative_eagle_topk: Annotated[int, typer.Option(help="1 = chain, more = EAGLE-2 tree")] = 1,
    speculative_num_draft_tokens: Annotated[int | None, typer.Option(help="tokens verified, root counted")] = None,
    speculative_shape: Annotated[str | None, typer.Option(help="the embedded decoder's shape by name instead of "
                                                          "the three flags above: chain3, chain5p0.4 (stops below "
                                                          "draft probability 0.4), tree4x4n12")] = None,
) -> None:
    """Embedded server for benchmarks: greedy requests decoded plainly or with EAGLE-3 (SGLang's flags)."""
    from eaglenest.engines.serving import serve as run
    from eaglenest.models import resolve_model
    from eaglenest.speculative.serve import SpecConfig, build_bench_engine
    from eaglenest.speculative.tree import SpecShape

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threads:
        import torch

        torch.set_num_threads(threads)
    if (speculative_algorithm is None) != (speculative_draft_model_path is None):
        raise typer.BadParameter("give both --speculative-algorithm EAGLE3 and --speculative-draft-model-path, "
                                 "or neither")
    if speculative_algorithm not in (None, "EAGLE3"):
        raise typer.BadParameter(f"--speculative-algorithm {speculative_algorithm}: only EAGLE3 is supported")
    if speculative_shape is not None and (speculative_num_steps is not None or speculative_eagle_topk != 1
                                          or speculative_num_draft_tokens is not None):
        raise typer.BadParameter("give --speculative-shape or the --speculative-num-steps/-eagle-topk/"
                                 "-num-draft-tokens flags, not both")
    if speculative_shape is not None and speculative_algorithm is None:
        raise typer.BadParameter("--speculative-shape needs --speculative-algorithm EAGLE3 and a draft")
    asked: SpecShape | None = None  # None: the measured best shape
    try:
        if speculative_shape is not None:
            asked = SpecShape.parse(speculative_shape)
        elif speculative_num_steps is not None:
            asked = SpecConfig(num_steps=speculative_num_steps, topk=speculative_eagle_topk,
                               num_draft_tokens=speculative_num_draft_tokens).shape
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    engine = build_bench_engine(resolve_model(model), draft_dir=speculative_draft_model_path, shape=asked,
                                dtype=dtype, onednn=onednn)
    shape = getattr(getattr(engine.greedy_decoder, "decoder", None), "shape", None)
    typer.echo(f"bench server: {engine.runner.model_dir} ({engine.runner.dtype_name}) "
               f"{f'EAGLE3 {speculative_draft_model_path} shape {shape.name}' if shape else 'plain'} "
               f"onednn={onednn} on http://{host}:{port}", err=True)
    run(engine, host=host, port=port)


@app.command()
@model_command(BenchConfig, names=BENCH_FLAGS)
def live(params: BenchConfig) -> None:
    """Baseline vs EAGLE3 at each concurrency; report + plots; exit 1 when the gate fails."""
    from eaglenest.speculative import bench as B
    from eaglenest.speculative.report import gate, write_report

    cfg, out = params, Path(params.output_dir)
    prompts = B.prepare_prompts(cfg)
    offline = B.offline_step(cfg)

    def show(name, lv):
        typer.echo(f"{name:8s} c={lv.concurrency:<3d} {lv.output_tok_s:8.1f} tok/s  p50 {lv.latency_p50_s:.2f}s "
                   f"accept {lv.accept_length if lv.accept_length is not None else '-'}  errors {lv.errors}", err=True)

    baseline, eagle3 = B.live_step(cfg, prompts, progress=show)
    report = B.assemble(cfg, prompts, baseline, eagle3, offline)
    paths = write_report(report, out)
    typer.echo((out / "report.md").read_text())
    typer.echo(f"files: {', '.join(str(p) for p in paths.values())}")
    g = gate(report, target_concurrency=cfg.target_concurrency, min_speedup=cfg.min_speedup)
    typer.echo(("GATE PASSED: " if g.passed else "GATE FAILED: ") + g.message)
    if not g.passed:
        raise typer.Exit(1)


@app.command()
def cpu(
    draft: Annotated[str, typer.Option(help="exported EAGLE-3 drafter ('random' = untrained smoke test)")],
    model: Annotated[str, typer.Option(help="target model")] = "default",
    prompt_set: Annotated[str, typer.Option(help="mt-bench | humaneval | sharegpt")] = "mt-bench",
    num_prompts: Annotated[int, typer.Option(help="prompts")] = 80,
    max_new_tokens: Annotated[int, typer.Option(help="new tokens per prompt")] = 128,
    rounds: Annotated[int, typer.Option(help="passes over the prompts")] = 1,
    shapes: Annotated[str, typer.Option(help="speculation shapes, e.g. chain3,tree4x4n12 (default: the measured "
                                        "best)")] = "",
    save_shape: Annotated[bool, typer.Option(help="make the fastest shape measured the default")] = False,
    dtype: Annotated[str, typer.Option(help="auto | bfloat16 | float32")] = "auto",
    threads: Annotated[int, typer.Option(help="torch CPU threads")] = 2,
    plain_policies: Annotated[str, typer.Option(help="oneDNN policies for plain greedy (default: "
                                                "eaglenest.speculative.cpu_bench.PLAIN_POLICIES)")] = "",
    spec_policies: Annotated[str, typer.Option(help="oneDNN policies for EAGLE-3 (default: SPEC_POLICIES)")] = "",
    out: Annotated[Path | None, typer.Option(help="JSON result (default results/cpu_spec_<time>.json)")] = None,
) -> None:
    """Wall-clock speedup, accept length and cycle cost of a drafter vs plain greedy, side by side."""
    import os
    import sys

    import torch

    from eaglenest.speculative.cpu_bench import default_json_path, run_cpu_bench, run_record, save_measured_shape

    torch.set_num_threads(threads)
    load = os.getloadavg()
    result = run_cpu_bench(model=model, draft=draft, prompt_set=prompt_set, num_prompts=num_prompts,
                           max_new_tokens=max_new_tokens, shapes=[s for s in shapes.split(",") if s] or None,
                           dtype=dtype, plain_policies=[p for p in plain_policies.split(",") if p] or None,
                           spec_policies=[p for p in spec_policies.split(",") if p] or None, rounds=rounds,
                           progress=lambda m: typer.echo(m, err=True))
    record = run_record(result, argv=sys.argv, load_before=load)
    typer.echo("\n".join(result.lines()))
    path = out or default_json_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    typer.echo(f"wrote {path}")
    if save_shape:
        typer.echo(f"default shape {result.best('eagle3').shape} saved to {save_measured_shape(result, path, record)}")


@app.command()
@model_command(BenchConfig, names=BENCH_FLAGS,
               only=frozenset({"model", "draft", "num_steps", "store_url", "heldout_fraction", "offline_max_samples"}))
def offline(
    params: BenchConfig,
    prompt_set: Annotated[list[str] | None, typer.Option(
        help="calibrate on a prompt set instead of a store (repeatable: mt-bench, humaneval, sharegpt): the target "
             "answers it greedily on the capture engine and the drafter is simulated on exactly those answers")] = None,
    prompts_file: Annotated[Path | None, typer.Option(
        help="the same from a prompt source written by `bench prompts --format messages` (offline machines)")] = None,
    live: Annotated[list[Path] | None, typer.Option(
        help="a live bench report.json or matrix.json of the same prompts (repeatable): offline and live side by "
             "side")] = None,
    depths: Annotated[str, typer.Option(help="chain depths to simulate on prompt sets")] = "1,2,3,4,5,6,7,8",
    shape: Annotated[list[str] | None, typer.Option(
        help="also replay this shape cycle by cycle on prompt sets (repeatable), e.g. tree6x4n15 = SGLang's "
             "--speculative-num-steps 6 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16")] = None,
    engine: Annotated[str, typer.Option(help="capture engine for prompt sets: embedded | sglang")] = "embedded",
    server_url: Annotated[list[str] | None, typer.Option(help="running capture server (repeatable)")] = None,
    num_prompts: Annotated[int | None, typer.Option(help="first N prompts of each set")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="answer cap (the live benchmark's max_new_tokens)")] = 256,
    out: Annotated[Path, typer.Option(help="folder: calibration.json/.md and the capture")] = Path("runs/calibration"),
    live_check: Annotated[int, typer.Option(help="also decode this many held-out prompts live (calibration)")] = 0,
    live_tokens: Annotated[int, typer.Option(help="new tokens per live-checked prompt")] = 64,
) -> None:
    """Simulated accept length of a drafter: on a store's held-out split, or calibrated on prompt sets."""
    from eaglenest.speculative.bench import model_path, offline_step

    # the store's estimate uses the default chain depth (SpecConfig.num_steps) unless --steps says another
    cfg = params if params.num_steps is not None else params.model_copy(update={"num_steps": params.chain_depth})
    if prompt_set or prompts_file:
        from eaglenest.speculative.tree import SpecShape

        try:
            shapes = [SpecShape.parse(x) for x in shape or []]
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--shape") from None
        _offline_on_prompts(draft=cfg.draft, prompt_sets=prompt_set or [], prompts_file=prompts_file,
                            live=live or [], model=cfg.model, depths=[int(x) for x in depths.split(",") if x],
                            shapes=shapes, engine=engine, server_urls=server_url or [], num_prompts=num_prompts,
                            max_new_tokens=max_new_tokens, out=out)
        return
    if shape:
        raise typer.BadParameter("shapes are replayed on prompt sets: give --prompt-set or --prompts-file",
                                 param_hint="--shape")
    if cfg.store_url is None:
        raise typer.BadParameter("give the store to read held-out samples from (or --prompt-set / --prompts-file "
                                 "to calibrate on prompt sets)", param_hint="--store")
    res = offline_step(cfg)
    typer.echo(json.dumps(res, indent=1))
    if live_check:
        from eaglenest.engines.runtime import TargetRunner
        from eaglenest.speculative.cpu_bench import live_accept_on_samples
        from eaglenest.speculative.draft import draft_aux_layer_ids
        from eaglenest.speculative.offline import calibrate
        from eaglenest.speculative.serve import load_spec_decoder
        from eaglenest.store import open_samples

        st = open_samples(cfg.store_url)
        by_id = {sid: i for i, sid in enumerate(st.sample_ids)}
        samples = [st[by_id[sid]] for sid in res["sample_ids"][:live_check]]
        runner = TargetRunner(model_path(cfg), aux_layer_ids=draft_aux_layer_ids(cfg.draft))
        live_res = live_accept_on_samples(load_spec_decoder(runner, cfg.draft, shape=cfg.spec_shape), samples,
                                          max_new_tokens=live_tokens)
        typer.echo(f"live on {len(samples)} held-out prompts: accept length {live_res.accept_length:.3f} "
                   f"({live_res.cycles} verify cycles, per-position {[round(x, 3) for x in live_res.acceptance_at]})")
        typer.echo(json.dumps(calibrate(res["accept_length_cycles"], live_res.accept_length).to_json()))


def _offline_on_prompts(*, draft, prompt_sets, prompts_file, live, model, depths, shapes, engine, server_urls,
                        num_prompts, max_new_tokens, out) -> None:
    from eaglenest.speculative import calibration as C

    settings = C.CaptureSettings(model=model, engine=engine, server_urls=server_urls, max_new_tokens=max_new_tokens)
    report = C.calibrate_prompt_sets(draft=draft, settings=settings, work_dir=out, prompt_sets=prompt_sets,
                                     prompts_file=prompts_file, num_prompts=num_prompts, live_reports=live,
                                     depths=depths, shapes=shapes)
    typer.echo(C.markdown(report))
    typer.echo(f"files: {out / 'calibration.json'}, {out / 'calibration.md'}")


@app.command()
def prompts(
    out: Annotated[Path, typer.Option(help="JSONL to write")],
    prompt_set: Annotated[list[str] | None, typer.Option(
        help="mt-bench | humaneval | sharegpt (repeatable with --format messages)")] = None,
    model: Annotated[str, typer.Option(help="target whose chat template tokenizes")] = "default",
    limit: Annotated[int | None, typer.Option(help="first N prompts (of each set)")] = None,
    format: Annotated[str, typer.Option(
        help="ids: chat-templated token ids for `bench live` / gpu_bench_grid.py; messages: the prompt source for "
             "`bench offline --prompts-file` / gpu_calibrate.py (the target answers it on the capture engine)",
    )] = "ids",
) -> None:
    """Write a named prompt set to a file that travels to the GPU machine (which has no network)."""
    from eaglenest.speculative import prompts as P

    names = prompt_set or ["mt-bench"]
    if format == "messages":
        from eaglenest.speculative.prompts import write_prompt_source

        sets = [P.load_prompt_set(n, limit=limit) for n in names]
        write_prompt_source(out, sets)
        typer.echo(f"{out}: " + ", ".join(f"{len(s.prompts)} prompts of {s.name}" for s in sets))
        return
    if format != "ids":
        raise typer.BadParameter(f"--format {format!r}: choose ids or messages")
    if len(names) != 1:
        raise typer.BadParameter("--format ids writes one prompt set per file")
    from transformers import AutoTokenizer

    from eaglenest.models import resolve_model

    ps = P.load_prompt_set(names[0], limit=limit)
    ids = P.tokenize(ps, AutoTokenizer.from_pretrained(str(resolve_model(model))))
    P.write_token_file(out, ps, ids)
    typer.echo(f"{out}: {len(ids)} prompts of {ps.name} ({ps.source})")


@app.command()
def depth(
    matrices: Annotated[list[Path], typer.Argument(help="matrix.json files of scripts/gpu_bench_grid.py")],
    out: Annotated[Path, typer.Option(help="folder for depth.json and depth.png")] = Path("."),
) -> None:
    """A depth sweep from live grids: speedup and accept length against draft steps, per prompt set and
    concurrency (depth.json, depth.png); prints the best depth of each."""
    import json

    from eaglenest.atomic import atomic_write_bytes
    from eaglenest.speculative.report import best_depths, depth_sweep, plot_depth_sweep

    try:
        rows = depth_sweep([json.loads(p.read_text()) for p in matrices])
    except (OSError, ValueError, KeyError) as e:
        raise typer.BadParameter(str(e)) from e
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "depth.json", json.dumps({"matrices": [str(p) for p in matrices], "rows": rows},
                                                      indent=1).encode())
    written = [str(out / "depth.json")]
    try:
        atomic_write_bytes(out / "depth.png", plot_depth_sweep(rows))
        written.append(str(out / "depth.png"))
    except ImportError:
        typer.echo("(no matplotlib here: depth.png not drawn)")
    for (name, conc), r in best_depths(rows).items():
        typer.echo(f"{name} c={conc}: best steps {r['steps']}, {r['speedup']:.2f}x, accept length "
                   f"{r['accept_length']:.2f}")
    typer.echo(", ".join(written))


@app.command()
def plot(report: Annotated[Path, typer.Argument(help="report.json (e.g. from scripts/gpu_bench_grid.py)")]) -> None:
    """Write report.md and the PNG plots next to a report.json."""
    from eaglenest.speculative.report import read_report, write_report

    paths = write_report(read_report(report), report.parent)
    typer.echo(", ".join(str(p) for p in paths.values()))
