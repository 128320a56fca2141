"""Offline vs live on the same prompts: the calibration of the offline accept length.

Owns the chain from a benchmark prompt set to an offline estimate that is comparable with a live
benchmark of the same prompts, and the side-by-side record:

    source = write_prompt_source(path, [mt_bench, humaneval])      # (prompts.py) JSONL {"id", "messages", "kind"}
    folder = capture_answers(source, CaptureSettings(model=..., engine="sglang", max_new_tokens=256), out)
    offline = simulate_prompt_sets(folder, model, draft, depths=range(1, 9))   # per prompt set, per depth
    report = side_by_side(offline, [BenchReport, ...])                         # offline | live | ratio

The target answers every prompt greedily on the capture engine (the extraction library with
regeneration on: the same chat template, the same engine, the same answer cap as the live
benchmark), so the captured samples are exactly what the live greedy decode produces, and the
simulation (:mod:`eaglenest.speculative.offline`) runs the drafter on exactly those samples. The number to
compare with live is ``accept_length_cycles`` (per verify cycle, as SGLang counts it, bonus token
included); the per-start mean is reported beside it and is higher whenever acceptance varies along
an answer. Sample ids are ``<prompt set>:<prompt id>``, so one capture run serves every set.

Invariants: a prompt set is never trained on (the captures live in their own extraction folder);
the drafter's aux layers must equal the capture's; prompt sets travel to an offline machine as the
JSONL :func:`~eaglenest.speculative.prompts.write_prompt_source` writes (the GPU machine has no network to fetch
the packages).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eaglenest.engines.sglang_guards import flag_value
from eaglenest.speculative.prompts import read_prompt_kinds, read_prompt_source, write_prompt_source
from eaglenest.speculative.tree import SpecShape

DEFAULT_DEPTHS = tuple(range(1, 9))


class CaptureSettings(BaseModel):
    """How the target answers the prompts and is captured (an extraction with regeneration on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("default", description="target: 'default' or a local HF folder")
    engine: Literal["embedded", "sglang"] = Field("embedded", description="capture engine (the serving engine)")
    server_urls: list[str] = Field([], description="already-running capture servers (default: launch one)")
    max_new_tokens: int = Field(256, ge=1, le=8192, description=(
        "answer cap: the live benchmark's max_new_tokens (the simulation scores the first this many answer tokens)"))
    answer_max_new_tokens: int | None = Field(None, ge=1, le=65536, description=(
        "how long the target may answer at capture (default: max_new_tokens, where the live benchmark cuts its "
        "answers; an answer cut there is kept, as live keeps it, and the simulation scores the first "
        "max_new_tokens tokens of each answer)"))
    max_tokens: int | None = Field(None, ge=8, description="prompt + answer token limit (default: the context)")
    batch_size: int = Field(256, ge=1, le=4096, description="samples per capture batch")
    concurrency: int = Field(64, ge=1, le=1024, description="requests in flight per server")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="capture dtype")
    server_capture_dir: str | None = Field(None, description="where given server_urls write shards, if they do not say")
    sglang_args: list[str] = Field([], description="extra sglang.launch_server arguments")
    extraction_id: str = Field("calibration", description="folder name under the output folder")
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="per-request timeout (a hung server)")


def capture_answers(source: str | Path, settings: CaptureSettings, output_dir: str | Path, *,
                    on_progress=None) -> tuple[Path, dict[str, Any]]:
    """Let the target answer every prompt greedily and capture it; returns (extraction folder, report)."""
    from eaglenest.extraction.config import ExtractParams, RegenerationParams
    from eaglenest.extraction.run import run_extraction

    params = ExtractParams(
        source=str(source), source_format="jsonl", limit=None, max_turns=1, model=settings.model,
        engine=settings.engine, server_urls=list(settings.server_urls), dtype=settings.dtype,
        batch_size=settings.batch_size, concurrency=settings.concurrency, max_tokens=settings.max_tokens,
        regeneration=RegenerationParams(
            enabled=True, temperature=0.0, cut_answers="keep",
            max_new_tokens=max(settings.answer_max_new_tokens or 0, settings.max_new_tokens)),
        extraction_id=settings.extraction_id, output_dir=str(output_dir), sglang_args=list(settings.sglang_args),
        server_capture_dir=settings.server_capture_dir, request_timeout_s=settings.request_timeout_s,
    )
    report = run_extraction(params, on_progress=on_progress)
    return Path(params.output_path).expanduser().resolve() / settings.extraction_id, report


@dataclass(frozen=True, kw_only=True, slots=True)
class SetOffline:
    """The drafter's simulated acceptance on one prompt set's captured greedy answers."""

    prompt_set: str
    samples: int
    target_agreement: float | None
    """Share of answer tokens equal to the target's greedy choice at capture (1.0 = exact replay; None: not
    measured, as in a training run's eval)."""
    by_depth: dict[int, dict[str, float]]
    """depth -> accept_length_cycles (compare with live), accept_length (per start), cycles, chains."""
    by_shape: dict[str, dict[str, float]] = field(default_factory=dict)
    """shape name (trees: ``tree6x4n15``) -> accept_length_cycles, cycles: replayed cycle by cycle."""
    by_kind: dict[str, dict[str, Any]] = field(default_factory=dict)
    """kind (the set's own grouping: MT-Bench's writing, roleplay, ...) -> samples and accept_length_cycles by depth:
    which kinds of prompt hold the set's accept length down (what to steer the training data toward)."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["by_depth"] = {str(k): v for k, v in self.by_depth.items()}
        d["by_kind"] = {k: {**v, "by_depth": {str(dd): x for dd, x in v["by_depth"].items()}}
                        for k, v in self.by_kind.items()}
        return d


def sets_from_eval(eval_sets: dict[str, dict[str, Any]]) -> list[SetOffline]:
    """The offline side as a training run already measured it: ``eval_sets`` of a train result (one entry per
    eval set, ``accept_length_cycles`` and ``accept_length`` by TTT depth), e.g. on the calibration capture."""
    out = []
    for name, ev in eval_sets.items():
        cyc, per_start = ev.get("accept_length_cycles"), ev.get("accept_length")
        if not cyc or not per_start:
            raise ValueError(f"eval set {name!r} has no accept_length_cycles/accept_length by depth: "
                             "not a training run's eval")
        out.append(SetOffline(prompt_set=name, samples=int(ev.get("samples", 0)), target_agreement=None,
                              by_depth={int(d): {"accept_length_cycles": float(cyc[d]),
                                                 "accept_length": float(per_start[d])} for d in cyc}))
    return out


class _CappedAnswers:
    """A store view whose answers (loss-masked turns) count only their first ``cap`` tokens: what a live
    request with max_new_tokens=cap generates of the same greedy answer."""

    def __init__(self, store, cap: int) -> None:
        self._store, self._cap = store, cap
        self.sample_ids = list(store.sample_ids)

    def __len__(self) -> int:
        return len(self._store)

    def __getitem__(self, i: int):
        s = self._store[i]
        return s.with_loss_mask(cap_turns(s.loss_mask, self._cap))


def cap_turns(loss_mask, cap: int):
    """``loss_mask`` with every run of answer tokens cut to its first ``cap`` tokens."""
    out = loss_mask.clone()
    run = 0
    for t, on in enumerate(loss_mask.tolist()):
        run = run + 1 if on else 0
        if run > cap:
            out[t] = False
    return out


def simulate_prompt_sets(store, draft, lm_head, *, depths: Sequence[int] = DEFAULT_DEPTHS,
                         aux_layer_ids: Sequence[int] | None = None, answer_cap: int | None = None,
                         shapes: Sequence[SpecShape] = (), kinds: Mapping[str, str] | None = None) -> list[SetOffline]:
    """Simulate ``draft`` on every sample of ``store``, grouped by the prompt set in its sample id (answers
    cut to their first ``answer_cap`` tokens, the live benchmark's max_new_tokens): chains at every depth in
    ``depths``, and each of ``shapes`` (trees) by replay. ``kinds`` ({sample id: kind}, :func:`read_prompt_kinds`):
    each set's chains also per kind of prompt."""
    from eaglenest.speculative.offline import replay_shapes, simulate_groups

    if aux_layer_ids is not None and tuple(aux_layer_ids) != draft.config.aux_layer_ids:
        raise ValueError(f"the captures hold aux layers {list(aux_layer_ids)}, the drafter reads "
                         f"{list(draft.config.aux_layer_ids)}: capture with the drafter's target settings")
    ids = list(getattr(store, "sample_ids", None) or [store[i].sample_id for i in range(len(store))])
    if answer_cap is not None:
        store = _CappedAnswers(store, answer_cap)
    groups: dict[str, list[int]] = {}
    for i, sid in enumerate(ids):
        groups.setdefault(sid.split(":", 1)[0] if ":" in sid else "samples", []).append(i)
    if not groups:
        raise ValueError("the capture holds no samples (did every prompt fail? see the extraction report)")
    out = []
    for name, idx in groups.items():
        of_kind: dict[str, list[int]] = {}
        for i in idx:
            if kind := (kinds or {}).get(ids[i]):
                of_kind.setdefault(kind, []).append(i)
        # the set and its kinds from one simulation: each sample drafted once
        sims = simulate_groups(store, draft, lm_head, {None: idx, **dict(sorted(of_kind.items()))}, tuple(depths))
        res = sims.pop(None)
        replayed = replay_shapes(store, draft, idx, shapes) if shapes else {}
        by_kind = {k: {"samples": len(of_kind[k]),
                       "by_depth": {d: r.accept_length_cycles for d, r in sorted(sim.items())}}
                   for k, sim in sims.items()}
        out.append(SetOffline(prompt_set=name, samples=len(idx), target_agreement=res[max(depths)].target_agreement,
                              by_depth={d: {"accept_length_cycles": r.accept_length_cycles,
                                            "accept_length": r.accept_length, "cycles": r.cycles,
                                            "chains": r.chains} for d, r in sorted(res.items())},
                              by_shape={k: {"accept_length_cycles": r.accept_length_cycles, "cycles": r.cycles}
                                        for k, r in replayed.items()},
                              by_kind=by_kind))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveAccept:
    prompt_set: str
    num_steps: int
    concurrency: int
    accept_length: float
    report: str
    shape: str = ""
    """The speculation's shape name (``chain3``, ``tree6x4n15``: SGLang's 16 draft tokens less the root)."""

    @property
    def replayed(self) -> SpecShape | None:
        """The shape whose offline estimate is a replay (a tree, a confidence-stopped or quantized chain); None for a
        plain chain, which the simulation scores by its depth."""
        shape = SpecShape.parse(self.shape) if self.shape else None
        return None if shape is None or shape == SpecShape(depth=self.num_steps) else shape


def _shape_name(num_steps: int, topk: Any, draft_tokens: Any) -> str:
    from eaglenest.speculative.serve import SpecConfig

    tokens = None if draft_tokens is None or int(topk or 1) == 1 else int(draft_tokens)
    return SpecConfig(num_steps=num_steps, topk=int(topk or 1), num_draft_tokens=tokens).shape.name


def live_accepts(report_json: dict[str, Any], path: str = "", draft: str | Path | None = None) -> list[LiveAccept]:
    """Per-concurrency live accept lengths of a bench report (``report.json`` of ``bench live`` or of one
    (set, steps) of gpu_bench_grid) or of a whole grid (its ``matrix.json``: rows of set, steps, concurrency;
    a grid of trees says ``topk`` in its rows or, in grids written before rows carried it, in its command).
    A grid that served several drafters side by side (rows naming their ``draft``) gives ``draft``'s rows (matched
    by folder name: the GPU's path differs from this machine's); without ``draft`` it is refused."""
    if "rows" in report_json:
        grid_topk = flag_value([str(x) for x in report_json.get("command") or []], "--topk") or 1
        rows = report_json["rows"]
        served = sorted({str(r["draft"]) for r in rows if r.get("draft")})
        if len(served) > 1:
            if draft is None:
                raise ValueError(f"{path or 'the grid'} served several drafters side by side ({', '.join(served)}): "
                                 "name the one whose live accept lengths to use")
            rows = [r for r in rows if Path(str(r.get("draft", ""))).name == Path(draft).name]
            if not rows:
                raise ValueError(f"{path or 'the grid'} served {', '.join(served)}, none named {Path(draft).name}")
        return [LiveAccept(prompt_set=str(r["prompt_set"]), num_steps=int(r["steps"]),
                           concurrency=int(r["concurrency"]), accept_length=float(r["accept_length"]), report=path,
                           shape=_shape_name(int(r["steps"]), r.get("topk", grid_topk), r.get("draft_tokens")))
                for r in rows if r.get("accept_length") is not None]
    spec = report_json.get("spec") or {}  # an embedded report names its shape (chain4p0.35, tree3x2n6q4)
    shape = spec.get("shape") or _shape_name(int(spec["num_steps"]), spec.get("topk", 1), spec.get("num_draft_tokens"))
    return [LiveAccept(prompt_set=str(report_json["prompt_set"]), num_steps=int(spec["num_steps"]),
                       concurrency=int(lv["concurrency"]), accept_length=float(lv["accept_length"]), report=path,
                       shape=shape)
            for lv in report_json["eagle3"]["levels"] if lv.get("accept_length") is not None]


@dataclass(kw_only=True, slots=True)
class CalibrationReport:
    model: str
    draft: str
    capture: dict[str, Any]
    sets: list[SetOffline]
    rows: list[dict[str, Any]] = field(default_factory=list)
    """One row per live measurement: prompt set, depth, concurrency, offline, live, ratio offline/live."""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "calibration", "model": self.model, "draft": self.draft, "capture": self.capture,
                "sets": [s.to_json() for s in self.sets], "rows": self.rows, "notes": self.notes}


def side_by_side(sets: Sequence[SetOffline], live: Sequence[LiveAccept]) -> list[dict[str, Any]]:
    """Rows pairing every live accept length with the offline estimate of the same set and shape (a chain's by
    its depth, a tree's by its replay)."""
    by_name = {s.prompt_set: s for s in sets}
    rows = []
    for lv in live:
        s = by_name.get(lv.prompt_set)
        off = (s.by_depth.get(lv.num_steps) if lv.replayed is None else s.by_shape.get(lv.shape)) if s else None
        est = off["accept_length_cycles"] if off else None
        rows.append({"prompt_set": lv.prompt_set, "depth": lv.num_steps, "shape": lv.shape or f"chain{lv.num_steps}",
                     "concurrency": lv.concurrency, "offline": est,
                     "offline_per_start": off.get("accept_length") if off else None,
                     "live": lv.accept_length, "ratio": est / lv.accept_length if est and lv.accept_length else None,
                     "report": lv.report})
    return rows


def markdown(report: CalibrationReport) -> str:
    depths = sorted({d for s in report.sets for d in s.by_depth})
    lines = [f"Offline accept length (per verify cycle, bonus counted) of {report.draft} on the target's greedy "
             f"answers ({report.capture.get('engine')}, answers capped at {report.capture.get('max_new_tokens')} "
             "tokens):", "",
             "| prompt set | samples | agreement | " + " | ".join(f"@{d}" for d in depths) + " |",
             "|---|---|---|" + "---|" * len(depths)]
    for s in report.sets:
        cells = [f"{s.by_depth[d]['accept_length_cycles']:.2f}" if d in s.by_depth else "-" for d in depths]
        agree = "-" if s.target_agreement is None else f"{s.target_agreement:.3f}"
        lines.append(f"| {s.prompt_set} | {s.samples} | {agree} | " + " | ".join(cells) + " |")
    shapes = sorted({k for s in report.sets for k in s.by_shape})
    if shapes:
        lines += ["", "Other shapes, replayed cycle by cycle (accept length per verify cycle):",
                  "", "| prompt set | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
        for s in report.sets:
            cells = [f"{s.by_shape[k]['accept_length_cycles']:.2f}" if k in s.by_shape else "-" for k in shapes]
            lines.append(f"| {s.prompt_set} | " + " | ".join(cells) + " |")
    kinds = [(s.prompt_set, k, v) for s in report.sets for k, v in s.by_kind.items()]
    if kinds:
        lines += ["", "By kind of prompt (accept length per verify cycle):", "",
                  "| prompt set | kind | samples | " + " | ".join(f"@{d}" for d in depths) + " |",
                  "|---|---|---|" + "---|" * len(depths)]
        for name, k, v in kinds:
            cells = [f"{v['by_depth'][d]:.2f}" if d in v["by_depth"] else "-" for d in depths]
            lines.append(f"| {name} | {k} | {v['samples']} | " + " | ".join(cells) + " |")
    if report.rows:
        lines += ["", "| prompt set | shape | concurrency | offline | offline per start | live | offline / live |",
                  "|---|---|---|---|---|---|---|"]
        for r in report.rows:
            def f(v):
                return "-" if v is None else f"{v:.2f}"
            lines.append(f"| {r['prompt_set']} | {r.get('shape') or r['depth']} | {r['concurrency']} | "
                         f"{f(r['offline'])} | {f(r['offline_per_start'])} | {f(r['live'])} | {f(r['ratio'])} |")
    return "\n".join([*lines, *(f"- {n}" for n in report.notes)]) + "\n"


def write_calibration(report: CalibrationReport, out_dir: str | Path) -> Path:
    from eaglenest.atomic import atomic_write_bytes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "calibration.md", markdown(report).encode())
    return atomic_write_bytes(out / "calibration.json", json.dumps(report.to_json(), indent=1).encode())


def calibrate_on_prompts(*, source: str | Path, draft: str | Path, settings: CaptureSettings, work_dir: str | Path,
                         live_reports: Sequence[str | Path] = (), depths: Sequence[int] = DEFAULT_DEPTHS,
                         shapes: Sequence[SpecShape] = (), device: str = "auto", on_progress=None
                         ) -> CalibrationReport:
    """Capture the target's greedy answers to ``source`` and put the drafter's offline estimate beside
    the live accept lengths of ``live_reports`` (bench report.json files of the same prompt sets)."""
    from eaglenest.models import auto_device, resolve_model
    from eaglenest.speculative.offline import load_offline_draft
    from eaglenest.store.extraction import open_samples as open_store

    folder, ext_report = capture_answers(source, settings, work_dir, on_progress=on_progress)
    if not ext_report.get("done"):
        raise ValueError(f"the capture of {source} produced no samples: see {folder}/report.json")
    store = open_store(str(folder))
    model_dir = resolve_model(settings.model)
    dev = auto_device(device)
    dr, head = load_offline_draft(model_dir, draft)
    dr, head = dr.to(dev), head.to(dev)  # the simulation is a few drafter forwards per sample: GPU-friendly
    prov = getattr(store, "provenance", None)
    live = [x for p in live_reports for x in live_accepts(json.loads(Path(p).read_text()), str(p), draft)]
    # every shape live ran that is not a plain chain is replayed too (a chain's depths are simulated anyway)
    wanted = {s.name: s for s in shapes}
    for lv in live:
        if lv.replayed is not None:
            wanted.setdefault(lv.shape, lv.replayed)
    sets = simulate_prompt_sets(store, dr, head, depths=depths, aux_layer_ids=getattr(prov, "aux_layer_ids", None),
                                answer_cap=settings.max_new_tokens, shapes=list(wanted.values()),
                                kinds=read_prompt_kinds(source))
    sources = read_prompt_source(source)
    counts = {k: ext_report.get(k) for k in ("samples", "done", "pending", "skipped", "bad_records")}
    counts["argmax_agreement"] = (ext_report.get("run") or {}).get("argmax_agreement")
    return CalibrationReport(
        model=str(model_dir), draft=str(draft),
        capture={**settings.model_dump(mode="json"), "folder": str(folder), "sources": sources, "counts": counts},
        sets=sets, rows=side_by_side(sets, live),
        notes=["offline = simulated accept length per verify cycle on the target's own greedy answers to the same "
               "prompts (what SGLang reports: (accepted drafts + verifies) / verifies); offline per start = the "
               "mean over every answer position (higher where acceptance varies along an answer)"])


def calibrate_prompt_sets(*, draft: str | Path, settings: CaptureSettings, work_dir: str | Path,
                          prompt_sets: Sequence[str] = (), prompts_file: str | Path | None = None,
                          num_prompts: int | None = None, live_reports: Sequence[str | Path] = (),
                          depths: Sequence[int] = DEFAULT_DEPTHS, shapes: Sequence[SpecShape] = ()
                          ) -> CalibrationReport:
    """Named prompt sets (first ``num_prompts`` of each) or a prompt source file -> the target's greedy answers
    captured under ``work_dir`` -> the offline estimate beside ``live_reports``, written to ``work_dir``
    (calibration.json / .md). What ``eaglenest bench offline --prompt-set`` and the bench flow run."""
    from eaglenest.speculative.prompts import load_prompt_set

    source = prompts_file
    if prompt_sets:
        source = write_prompt_source(Path(work_dir) / "prompts.jsonl",
                                     [load_prompt_set(n, limit=num_prompts) for n in prompt_sets])
    if source is None:
        raise ValueError("give prompt sets or a prompt source file to calibrate on")
    report = calibrate_on_prompts(source=source, draft=draft, settings=settings, work_dir=work_dir,
                                  live_reports=live_reports, depths=depths, shapes=shapes)
    write_calibration(report, work_dir)
    return report
