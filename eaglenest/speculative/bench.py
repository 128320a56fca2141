"""The speculative-decoding benchmark as one validated configuration and a few composable steps.

Owns :class:`BenchConfig` (pydantic: the Prefect flow's parameter form, the CLI's options and the
record saved beside every report) and the steps the CLI, the Prefect tasks and the GPU script run:

    prompts = prepare_prompts(cfg)                  # named set from a package, chat-templated ids
    offline = offline_step(cfg)                     # store simulation on held-out samples (optional)
    baseline, eagle3 = live_step(cfg, prompts)      # launch target twice, drive each concurrency level
    report = assemble(cfg, prompts, baseline, eagle3, offline); write_report(report, cfg.output_dir)
    require_gate(report, target_concurrency=cfg.target_concurrency, min_speedup=cfg.min_speedup)

Servers: ``engine="sglang"`` runs ``python -m sglang.launch_server`` (baseline with CUDA graphs on
unless disabled); ``engine="embedded"`` runs ``python -m eaglenest bench serve`` (the embedded engine
with the EAGLE-3 decoder, in the measured best shape unless ``shape`` or the SGLang flags say otherwise).
Both are owned by :class:`~eaglenest.engines.pool.ServerProcess`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eaglenest.engines import VerifyKernel
from eaglenest.forms import show_bounds
from eaglenest.speculative.serve import SGLANG_BEST, SpecConfig
from eaglenest.speculative.tree import SpecShape, measured_best_shape

OneDNNPolicy = Literal["onednn", "no-onednn", "prefill-only", "prefill+verify"]


BASELINE_PLACEMENT_FLAGS = frozenset({"--model-path", "--model", "--host", "--port", "--base-gpu-id", "--tp-size",
                                      "--mem-fraction-static"})
"""Flags the benchmark places its servers with; a baseline's own arguments may not move it."""


class BenchConfig(BaseModel):
    """Baseline vs EAGLE3 at several concurrencies, and whether the drafter may ship."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=show_bounds)

    engine: Literal["embedded", "sglang"] = Field("embedded", description="embedded (CPU) or sglang (GPU)")
    model: str = Field("default", description="target: 'default' (SmolLM2-135M-Instruct) or a local HF folder")
    draft: str = Field(..., description="exported EAGLE-3 drafter folder (SGLang format)")
    num_steps: int | None = Field(None, ge=1, le=16, description="draft steps per cycle (--speculative-num-steps; "
                                  "none of the three: the measured best shape, on SGLang steps 7 x topk 8 x 48 "
                                  "tokens, on the embedded engine eaglenest/speculative/cpu_shape.json, by CPU kind)")
    topk: int = Field(1, ge=1, le=16, description="branching per step (--speculative-eagle-topk); 1 = chain")
    num_draft_tokens: int | None = Field(
        None, ge=2, description="tokens verified per cycle INCLUDING the root (SGLang's count); default steps + 1")
    shape: str | None = Field(
        None, description="embedded: the CPU decoder's speculation shape by name (chain1, chain4p0.35, tree4x4n12) "
        "instead of num_steps/topk/num_draft_tokens; with none of them the measured best shape "
        "(eaglenest/speculative/cpu_shape.json, by kind of CPU: AMX or not)")
    prompt_set: Literal["mt-bench", "humaneval", "sharegpt"] = Field("mt-bench", description="named prompt set")
    prompt_file: str | None = Field(None, description="token-id JSONL from `eaglenest bench prompts` (overrides set)")
    num_prompts: int | None = Field(32, ge=1, description="first N prompts of the set (None: all)")
    max_prompt_tokens: int | None = Field(1024, ge=1, description="drop prompts longer than this")
    max_new_tokens: int = Field(128, ge=1, le=8192, description="output tokens per request (greedy)")
    ignore_eos: bool = Field(False, description="generate max_new_tokens even past EOS")
    concurrencies: list[int] = Field([1, 4, 16, 64], min_length=1, description="requests in flight per level")
    requests_per_level: int | None = Field(None, ge=1, description="default: max(prompts, 2 x concurrency)")
    rounds: int = Field(1, ge=1, description="> 1: the baseline and EAGLE3 servers up together (SGLang: each its "
                        "share of the GPU's memory) and every level in this many alternating rounds over slices "
                        "of the prompts, so the machine's drift weighs on both alike (even: each leads as often)")
    target_concurrency: int = Field(1, ge=1, description="the concurrency the gate judges (yours in production)")
    min_speedup: float = Field(1.0, ge=0.0, description="fail when EAGLE3 tok/s / baseline tok/s is below this")
    output_dir: str = Field("runs/bench", description="report.json, report.md, tok_s.png, accept_length.png")
    port: int | None = Field(None, ge=1, le=65535, description="server port (default: a free one; sglang 30000)")
    ready_timeout_s: float = Field(900.0, gt=0, description="launch + first real request must succeed within this")
    request_timeout_s: float = Field(600.0, gt=0, description="per-request client timeout")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="embedded servers' numerics (auto: bfloat16 where the CPU is fast at it)")
    onednn_baseline: OneDNNPolicy = Field("prefill-only", description="embedded baseline's oneDNN policy")
    onednn_eagle3: OneDNNPolicy = Field(
        "prefill+verify", description="embedded EAGLE3 server's oneDNN policy (1-token steps run best without)")
    threads: int | None = Field(None, ge=1, description="embedded: torch CPU threads per server (default torch's)")
    cuda_graph: bool = Field(True, description="sglang: keep CUDA graphs on (benchmarks)")
    attention_backend: str | None = Field("triton", description="sglang --attention-backend")
    sampling_backend: str | None = Field("pytorch", description="sglang --sampling-backend")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="sglang --mem-fraction-static")
    sglang_args: list[str] = Field([], description="extra sglang.launch_server arguments (both servers)")
    baseline_sglang_args: list[str] = Field(
        [], description="more arguments for the baseline server only, after the shared ones (a later flag wins): "
        "the plain server as fast as you would run it, e.g. another --attention-backend (the fastest one for plain "
        "decoding need not be EAGLE3's: results/2026-12-06f-h100)")
    verify_kernel: VerifyKernel = Field(
        "sglang", description="sglang: the EAGLE3 server's tree-verify attention, SGLang's own (its prefill kernel) "
        "or eaglenest's split-KV kernel (eaglenest.engines.sglang_tree_verify, through the plugin; triton attention "
        "backend)")
    python: str | None = Field(None, description="interpreter that runs the server (default: this one)")
    store_url: str | None = Field(None, description="store for the offline accept length (optional)")
    heldout_fraction: float = Field(0.05, gt=0, le=1, description="the drafter's eval_fraction (held-out split)")
    offline_max_samples: int = Field(200, ge=1, description="the drafter's eval_max_samples (held-out cap)")
    offline_on_prompts: bool = Field(
        False, description="offline accept length on THIS run's prompts: the target answers the prompt set greedily "
        "on the capture engine (same engine, same answer cap), the answers are captured and the drafter is "
        "simulated on exactly them (the calibration; needs a named prompt_set, not a prompt_file)")
    capture_server_urls: list[str] = Field([], description="offline_on_prompts: running capture servers "
                                           "(default: launch one for the engine)")

    @model_validator(mode="after")
    def _check(self) -> BenchConfig:
        try:
            self.spec  # noqa: B018 (validates the three flags together)
        except ValueError as e:
            raise ValueError(f"num_steps/topk/num_draft_tokens: {e}") from None
        if self.shape is not None:
            if self.engine != "embedded":
                raise ValueError("shape is the embedded decoder's; SGLang takes num_steps/topk/num_draft_tokens")
            if self._sglang_flags_given():
                raise ValueError("give shape or num_steps/topk/num_draft_tokens, not both")
            SpecShape.parse(self.shape)  # a bad name is this config's error
        if self.target_concurrency not in self.concurrencies:
            raise ValueError(f"target_concurrency={self.target_concurrency} is not among concurrencies "
                             f"{self.concurrencies}")
        if any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies must be >= 1: {self.concurrencies}")
        if self.verify_kernel != "sglang" and (self.engine != "sglang" or self.attention_backend != "triton"):
            raise ValueError(f"verify_kernel={self.verify_kernel}: replaces SGLang's triton verify kernel, so it needs "
                             f"engine sglang and attention_backend triton (got {self.engine}, "
                             f"{self.attention_backend})")
        if self.baseline_sglang_args and self.engine == "embedded":
            raise ValueError("baseline_sglang_args: arguments of an SGLang baseline server (engine sglang)")
        flags = [a.split("=", 1)[0] for a in self.baseline_sglang_args if a.startswith("--")]
        if spec := [f for f in flags if f.startswith("--speculative")]:
            raise ValueError(f"baseline_sglang_args {spec}: the baseline decodes without speculation")
        if placed := [f for f in flags if f in BASELINE_PLACEMENT_FLAGS]:
            raise ValueError(f"baseline_sglang_args {placed}: where the servers run and what memory they share is "
                             "the benchmark's (port, mem_fraction_static, sglang_args)")
        if self.rounds > 1 and self.requests_per_level:
            raise ValueError("rounds: each round sends its slice of the prompts (at least 2 x concurrency requests); "
                             "requests_per_level applies to plain levels only")
        if self.rounds > 1 and self.num_prompts is not None and self.rounds > self.num_prompts:
            raise ValueError(f"rounds={self.rounds} > num_prompts={self.num_prompts}: each round needs a prompt")
        if self.offline_on_prompts and self.prompt_file:
            raise ValueError("offline_on_prompts: the target answers the named prompt_set's messages; a prompt_file "
                             "holds token ids only (drop prompt_file, or write the set with `bench prompts --format "
                             "messages` and use `bench offline --prompts-file`)")
        return self

    @property
    def spec(self) -> SpecConfig:
        """SGLang's flags: none given, the measured best shape (:data:`~eaglenest.speculative.serve.SGLANG_BEST`);
        topk or draft tokens without num_steps, SpecConfig's default depth."""
        if not self._sglang_flags_given():
            return SGLANG_BEST
        steps = {} if self.num_steps is None else {"num_steps": self.num_steps}
        return SpecConfig(**steps, topk=self.topk, num_draft_tokens=self.num_draft_tokens)

    @property
    def chain_depth(self) -> int:
        """The depth of a chain where only a chain will do (the speculators export's speculative tokens, the store
        simulation's default): num_steps when given, else SpecConfig's default (the measured best chain)."""
        return self.num_steps if self.num_steps is not None else SpecConfig().num_steps

    def _sglang_flags_given(self) -> bool:
        return self.num_steps is not None or self.topk != 1 or self.num_draft_tokens is not None

    @property
    def spec_shape(self) -> SpecShape:
        """What EAGLE3 runs: SGLang's flags; on the embedded engine ``shape``, else the flags when given, else
        the measured best shape."""
        if self.engine == "embedded":
            if self.shape is not None:
                return SpecShape.parse(self.shape)
            if not self._sglang_flags_given():
                return measured_best_shape()
        return self.spec.shape


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompts:
    name: str
    source: str
    token_ids: list[list[int]]


def model_path(cfg: BenchConfig) -> str:
    if cfg.engine == "embedded":
        from eaglenest.models import resolve_model

        return str(resolve_model(cfg.model))
    return cfg.model


def prepare_prompts(cfg: BenchConfig) -> Prompts:
    """The configured prompt set, chat-templated with the target's tokenizer (or a prepared token file)."""
    from eaglenest.speculative import prompts as P

    if cfg.prompt_file:
        header, ids = P.read_token_file(cfg.prompt_file)
        ids = [x for x in ids if cfg.max_prompt_tokens is None or len(x) <= cfg.max_prompt_tokens]
        return Prompts(name=str(header.get("prompt_set", "file")), source=str(header.get("source", cfg.prompt_file)),
                       token_ids=ids[: cfg.num_prompts] if cfg.num_prompts else ids)
    from transformers import AutoTokenizer

    ps = P.load_prompt_set(cfg.prompt_set, limit=cfg.num_prompts)
    tok = AutoTokenizer.from_pretrained(model_path(cfg))
    ids = P.tokenize(ps, tok, max_prompt_tokens=cfg.max_prompt_tokens)
    return Prompts(name=ps.name, source=ps.source, token_ids=ids)


def server_commands(cfg: BenchConfig, port: int, *eagle_ports: int,
                    variants: Sequence[BenchConfig] = ()) -> list[list[str]]:
    """The baseline's launch command, then one EAGLE3 server's per variant (``variants``: configs that differ
    from ``cfg`` in the drafter, the shape or the verify kernel; none: ``cfg`` itself). Without ``eagle_ports``
    every server listens on ``port`` (one after another); with them (one per EAGLE3 server) all are up at once
    (``rounds`` > 1), and SGLang servers share the GPU's memory as the extraction's servers do, the user's
    ``--mem-fraction-static`` being what they hold together."""
    import sys

    eagles = list(variants) or [cfg]
    if eagle_ports and len(eagle_ports) != len(eagles):
        raise ValueError(f"{len(eagles)} EAGLE3 servers need as many ports, got {list(eagle_ports)}")
    ports = list(eagle_ports) or [port] * len(eagles)
    model = model_path(cfg)
    py = cfg.python or sys.executable
    if cfg.engine == "sglang":
        from eaglenest.engines.sglang_flags import sglang_placements
        from eaglenest.speculative.live import sglang_command

        kw: dict[str, Any] = dict(cuda_graph=cfg.cuda_graph, attention_backend=cfg.attention_backend,
                                  sampling_backend=cfg.sampling_backend, python=py)
        args = list(cfg.sglang_args)
        if cfg.rounds == 1:
            extras = [args] * (1 + len(eagles))
            kw["mem_fraction_static"] = cfg.mem_fraction_static
        else:
            total = [*args, *(["--mem-fraction-static", str(cfg.mem_fraction_static)] if cfg.mem_fraction_static
                              else [])]
            extras = [p.flags(total) for p in sglang_placements(total, num_servers=1 + len(eagles), gpus=1)]
        return [sglang_command(model, port=port, extra=[*extras[0], *cfg.baseline_sglang_args], **kw),
                *(sglang_command(model, port=p, draft=v.draft, spec=v.spec, extra=x, **kw)
                  for v, p, x in zip(eagles, ports, extras[1:], strict=True))]
    from eaglenest.speculative.serve import bench_serve_command

    base = bench_serve_command(model=model, port=port, dtype=cfg.dtype, onednn=cfg.onednn_baseline,
                               threads=cfg.threads)
    return [[py, *base[1:]], *([py, *bench_serve_command(model=model, port=p, dtype=cfg.dtype, onednn=cfg.onednn_eagle3,
                                                         draft=v.draft, shape=v.spec_shape, threads=cfg.threads)[1:]]
                                for v, p in zip(eagles, ports, strict=True))]


def eagle3_env(cfg: BenchConfig) -> dict[str, str]:
    """What the EAGLE3 server's environment adds (the baseline's adds nothing): the plugin and its verify kernel."""
    if cfg.verify_kernel == "sglang":
        return {}
    from eaglenest.engines import ENV_VERIFY_KERNEL
    from eaglenest.engines.sglang_launcher import plugin_loading_env

    return {ENV_VERIFY_KERNEL: cfg.verify_kernel, **plugin_loading_env(Path(cfg.output_dir) / "plugin-site")}


def live_step(cfg: BenchConfig, prompts: Prompts, *, progress=None):
    """Launch baseline then EAGLE3 (each in its own process group; both at once with ``rounds`` > 1) and measure
    every level."""
    from eaglenest.engines.pool import free_port, local_server
    from eaglenest.speculative.live import live_grid

    port = cfg.port or (30000 if cfg.engine == "sglang" else free_port())
    eagle_port = port
    while cfg.rounds > 1 and eagle_port == port:  # both up at once: two ports
        eagle_port = port + 1 if cfg.port or cfg.engine == "sglang" else free_port()
    base_cmd, eagle_cmd = server_commands(cfg, port, eagle_port)
    logs = Path(cfg.output_dir) / "logs"
    return live_grid(
        local_server(base_cmd, port=port, log_path=logs / "baseline.log"),
        local_server(eagle_cmd, port=eagle_port, log_path=logs / "eagle3.log", env=eagle3_env(cfg)),
        prompts.token_ids, cfg.concurrencies, rounds=cfg.rounds, max_new_tokens=cfg.max_new_tokens,
        ignore_eos=cfg.ignore_eos, requests_per_level=cfg.requests_per_level, ready_timeout_s=cfg.ready_timeout_s,
        timeout_s=cfg.request_timeout_s, progress=progress, pidfile=pidfile(cfg),
    )


def pidfile(cfg: BenchConfig) -> Path:
    """Where the live step records its server process groups (for teardown after a crash)."""
    return Path(cfg.output_dir) / "servers.json"


def offline_step(cfg: BenchConfig) -> dict[str, Any] | None:
    """Offline accept length of the drafter: on this run's prompts (``offline_on_prompts``), else on the
    store's held-out samples (None without either)."""
    if cfg.offline_on_prompts:
        return _offline_on_prompts(cfg)
    if not cfg.store_url:
        return None
    from eaglenest.speculative.offline import (
        heldout_indices,
        load_offline_draft,
        offline_accept_length,
        replay_shapes,
    )
    from eaglenest.store import open_samples

    store = open_samples(cfg.store_url)
    draft, head = load_offline_draft(model_path(cfg), cfg.draft)
    prov = getattr(store, "provenance", None)
    shape = cfg.spec_shape
    res = offline_accept_length(store, draft, head, num_steps=shape.depth,
                                heldout_fraction=cfg.heldout_fraction,
                                max_samples=cfg.offline_max_samples,
                                aux_layer_ids=getattr(prov, "aux_layer_ids", None)).to_json()
    if shape.is_chain:
        return res
    if res["target_agreement"] < TREE_REPLAY_MIN_AGREEMENT:  # the data would play a verify the target does not
        return {**res, "note": f"{shape.name} not replayed: the store's answers are the target's greedy choice at "
                               f"{res['target_agreement']:.3f} of their tokens (a replay needs the target's own "
                               "answers: the regeneration recipe); the chain of its depth stands in"}
    idx = heldout_indices(store, cfg.heldout_fraction, min(cfg.offline_max_samples or TREE_REPLAY_SAMPLES,
                                                           TREE_REPLAY_SAMPLES))
    return with_tree(res, replay_shapes(store, draft, idx, [shape])[shape.name])


TREE_REPLAY_MIN_AGREEMENT = 0.98
"""A tree is replayed only on answers the target wrote greedily (the data plays the verify)."""
TREE_REPLAY_SAMPLES = 64
"""Held-out samples a tree is replayed on (one proposer call per cycle on the CPU, before the live servers start)."""


def with_tree(chain: dict[str, Any], tree) -> dict[str, Any]:
    """An offline result for a tree: its replay is the estimate (``accept_length_cycles``, comparable with live);
    the chain of its depth, simulated on the same prompts, goes under ``chain``."""
    keep = ("source", "prompt_set", "samples", "target_agreement", "sample_ids", "calibration_dir")
    return {**{k: chain[k] for k in keep if k in chain}, "shape": tree.shape,
            "accept_length_cycles": tree.accept_length_cycles, "accept_length": None, "cycles": tree.cycles,
            "replay_samples": tree.samples, "chain": chain}


def _offline_on_prompts(cfg: BenchConfig) -> dict[str, Any]:
    from eaglenest.speculative import calibration as C

    shape = cfg.spec_shape
    work, depth = Path(cfg.output_dir) / "calibration", shape.depth
    settings = C.CaptureSettings(model=cfg.model, engine=cfg.engine, server_urls=cfg.capture_server_urls,
                                 max_new_tokens=cfg.max_new_tokens, sglang_args=cfg.sglang_args)
    report = C.calibrate_prompt_sets(draft=cfg.draft, settings=settings, work_dir=work, prompt_sets=[cfg.prompt_set],
                                     num_prompts=cfg.num_prompts, depths=sorted({*C.DEFAULT_DEPTHS, depth}),
                                     shapes=[] if shape.is_chain else [shape])
    (one,) = report.sets
    at = one.by_depth[depth]
    out = {"source": "prompts", "prompt_set": one.prompt_set, "samples": one.samples, "num_steps": depth,
           "accept_length_cycles": at["accept_length_cycles"], "accept_length": at["accept_length"],
           "cycles": at["cycles"], "target_agreement": one.target_agreement,
           "by_depth": {str(d): v["accept_length_cycles"] for d, v in one.by_depth.items()},
           "calibration_dir": str(work)}
    if shape.is_chain:
        return out
    from eaglenest.speculative.offline import ReplayResult

    tree = one.by_shape[shape.name]
    return with_tree(out, ReplayResult(shape=shape.name, samples=one.samples, cycles=tree["cycles"],
                                       accept_length_cycles=tree["accept_length_cycles"]))


def _spec_json(cfg: BenchConfig) -> dict[str, Any]:
    """The report's speculation settings in SGLang's terms (num_draft_tokens counts the root), and the embedded
    decoder's shape by name."""
    shape = cfg.spec_shape
    out: dict[str, Any] = {"num_steps": shape.depth, "topk": shape.topk, "num_draft_tokens": shape.nodes + 1}
    return {**out, "shape": shape.name} if cfg.engine == "embedded" else out


def recorded_config(cfg: BenchConfig, prompts: Prompts) -> BenchConfig:
    """The config as run: a prompt file's own set name replaces the unused ``prompt_set`` default."""
    from eaglenest.speculative.prompts import PROMPT_SETS

    if cfg.prompt_file and prompts.name in PROMPT_SETS:
        return cfg.model_copy(update={"prompt_set": prompts.name})
    return cfg


def assemble(cfg: BenchConfig, prompts: Prompts, baseline, eagle3, offline: dict[str, Any] | None = None):
    from eaglenest.speculative.report import BenchReport

    report = BenchReport(
        engine=cfg.engine, model=model_path(cfg), draft=cfg.draft,
        spec=_spec_json(cfg),
        prompt_set=prompts.name, prompt_source=prompts.source, num_prompts=len(prompts.token_ids),
        max_new_tokens=cfg.max_new_tokens, baseline=baseline, eagle3=eagle3, offline=offline,
        notes=[f"config: {recorded_config(cfg, prompts).model_dump_json()}"],
    )
    live = report.live_accept_length()
    from eaglenest.speculative.report import offline_estimate

    est = offline_estimate(offline) if offline else None
    if est and live:
        from eaglenest.speculative.offline import calibrate

        report = dataclasses.replace(report, calibration=calibrate(est, live).to_json())
    return report
