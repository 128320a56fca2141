"""The embedded server as a benchmark target: plain or EAGLE-3 greedy decoding behind SGLang's API.

Owns the glue between :mod:`eaglenest.speculative.decoder` and the embedded engine's opt-in
``greedy_decoder`` hook, and the command line that starts such a server in its own process
(``python -m eaglenest bench serve ...``), so the live benchmark drives it exactly like SGLang:

- :class:`SpecGreedy` answers greedy, uncaptured requests with speculative decoding and reports
  SGLang's ``meta_info`` fields (``spec_verify_ct``, ``spec_accept_length`` = completion tokens /
  verify forwards, bonus token counted) and ``/get_server_info`` fields (``speculative_algorithm``,
  ``internal_states[0].avg_spec_accept_length``).
- :class:`PlainGreedy` is the baseline with the same oneDNN policy machinery (so the baseline
  server can run the best plain setting, not the default one).

The spec flags mirror SGLang's names; ``--speculative-num-draft-tokens`` counts the root token, so
chain speculation (topk 1) requires ``num_draft_tokens == num_steps + 1``; topk > 1 runs an EAGLE-2
tree (:mod:`eaglenest.speculative.tree`). Without flags the embedded decoder runs the measured best shape.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.engines.runtime import Generation, TargetRunner
from eaglenest.speculative.decoder import SpecDecoder, plain_greedy
from eaglenest.speculative.onednn import OneDNN
from eaglenest.speculative.target import decode_target
from eaglenest.speculative.tree import SpecShape, measured_best_shape


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecConfig:
    """EAGLE-3 speculation settings, in SGLang's terms."""

    num_steps: int = 7
    """Draft forwards per cycle (--speculative-num-steps). The default is the measured best chain depth in SGLang on
    the H200 (MT-Bench, 40 prompts x 256, one round each, concurrency 1): the sweep of results/2026-12-03b-h200/depth
    (v32) steps 3 / 5 / 7 / 10 accept 2.24 / 2.50 / 2.57 / 2.62 at 0.88x / 1.08x / 1.11x / 1.06x of plain decoding (at
    16: 0.58x / 0.53x / 0.77x / 0.70x; steps 7 also best on HumanEval and ShareGPT); with v32c
    (results/2026-12-03c-h200) steps 3 0.91x, steps 7 1.11x; v32e (2026-12-03e) 1.21x / 1.42x. One-round speedups
    swing 10-30% between runs, accept lengths do not. A tree beats every chain: :data:`SGLANG_BEST` is what runs
    when no shape is asked for."""
    topk: int = 1
    """Branching per draft step (--speculative-eagle-topk); 1 = a chain, more = an EAGLE-2 tree."""
    num_draft_tokens: int | None = None
    """Tokens verified per cycle INCLUDING the root (--speculative-num-draft-tokens); default num_steps + 1."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        n = self.draft_tokens
        if self.topk == 1 and n != self.num_steps + 1:
            raise ValueError(f"num_draft_tokens={n} with topk=1 must be num_steps + 1 = {self.num_steps + 1} "
                             "(SGLang counts the root token in --speculative-num-draft-tokens)")
        try:  # the tree's bounds live in SpecShape: SGLang picks the tokens from topk + (steps-1)*topk^2 candidates
            self.shape  # noqa: B018
        except ValueError as e:
            raise ValueError(f"num_draft_tokens={n} (root counted) with num_steps={self.num_steps} topk={self.topk}: "
                             f"{e}") from None

    @property
    def draft_tokens(self) -> int:
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1

    @property
    def shape(self) -> SpecShape:
        """The embedded decoder's shape for these flags."""
        return SpecShape(depth=self.num_steps, topk=self.topk,
                         draft_tokens=None if self.topk == 1 else self.draft_tokens - 1)  # a chain's is its depth

    @classmethod
    def of(cls, shape: SpecShape) -> SpecConfig:
        if shape.min_prob or shape.quant:
            what = "confidence stop (min_prob)" if shape.min_prob else f"quantized drafter weights ({shape.quant})"
            raise ValueError(f"{shape.name}: SGLang's flags have no {what}")
        return cls(num_steps=shape.depth, topk=shape.topk, num_draft_tokens=shape.nodes + 1)

    def sglang_args(self, draft_path: str | Path) -> list[str]:
        return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_path),
                "--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", str(self.topk),
                "--speculative-num-draft-tokens", str(self.draft_tokens)]


SGLANG_BEST = SpecConfig(num_steps=6, topk=10, num_draft_tokens=64)
"""What SGLang runs when no speculation flag is given: the measured best shape, an EAGLE-2 tree of 6 draft steps, 10
branches a step and 64 verified tokens (root counted). Measured on an H100 with n18-t16000 (results/2026-12-07f-h100,
MT-Bench, 40 prompts x 256, greedy, concurrency 1, every tree's server up together with one baseline in four
alternating rounds): it accepts 4.39 a cycle at 1.44x the baseline, 1.064x the tok/s of 7x8x48 (the default before:
4.26 at 1.36x; every round faster, 1.00-1.12x) and ahead of 6x12x80, 7x8x64, 5x10x64, 6x10x48 and 5x12x64 (medians
0.95-1.00x of it; a second call repeated it at 1.44x). A draft step costs the cycle more than verified tokens do:
one step fewer with two more branches accepts as much. Before (n9n10, results/2026-12-06-h100) 7x8x48 ran at 1.44x
in alternating rounds against 8x8x48 1.43x, 9x8x56 1.45x, 8x16x64 1.44x; the 6x4x16 tree that was the default
before that (1.53-1.74x on 2026-12-03e's H200 with v32e) ran at 1.00x with n7 on an H100: SGLang's cycle at 1
request moved 1.5x between machines (its fixed cost is GPU work, results/2026-12-06g-h100), so the wide tree, whose
extra verified tokens cost little, pays where the cycle is dear. Concurrency 16 was not measured for the trees (the
steps-3 chain at 16: 0.76x-1.17x)."""


class SpecGreedy:
    """``greedy_decoder`` for the embedded engine: EAGLE-3 speculation (chain or tree)."""

    def __init__(self, decoder: SpecDecoder) -> None:
        self.decoder = decoder

    def generate_greedy(self, input_ids: Sequence[int], *, max_new_tokens: int, ignore_eos: bool) -> Generation:
        g = self.decoder.generate(input_ids, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        return Generation(g.output_ids, g.finish_reason, None, g.prefill_s, g.decode_s, spec_verify_ct=g.verify_ct,
                          spec_correct_drafts=sum(g.accepted), spec_proposed_drafts=sum(g.drafted))

    def server_info(self, stats: dict[str, Any]) -> dict[str, Any]:
        verify, correct = stats.get("spec_verify_ct", 0), stats.get("spec_correct_drafts", 0)
        shape = self.decoder.shape
        info: dict[str, Any] = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": shape.depth,
                                "speculative_eagle_topk": shape.topk, "speculative_num_draft_tokens": shape.nodes + 1,
                                "speculative_shape": shape.name, "onednn": self.decoder.onednn.name}
        if verify:
            info["internal_states"] = [{"avg_spec_accept_length": (correct + verify) / verify}]
        return info


class PlainGreedy:
    """``greedy_decoder`` for the baseline: KV-cached greedy decoding under a chosen oneDNN policy."""

    def __init__(self, runner: TargetRunner, onednn: OneDNN) -> None:
        self.runner, self.onednn = runner, onednn
        decode_target(runner.model, runner.aux_layer_ids)  # built now, on the caller's thread, not in a request

    def generate_greedy(self, input_ids: Sequence[int], *, max_new_tokens: int, ignore_eos: bool) -> Generation:
        g = plain_greedy(self.runner, input_ids, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                         onednn=self.onednn)
        return Generation(g.output_ids, g.finish_reason, None, g.prefill_s, g.decode_s)

    def server_info(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {"speculative_algorithm": None, "onednn": self.onednn.name}


def load_spec_decoder(runner: TargetRunner, draft_dir: str | Path, *, shape: SpecShape | str | None = None,
                      num_steps: int | None = None, onednn: OneDNN = OneDNN()) -> SpecDecoder:
    """An EAGLE-3 decoder over ``runner`` with the exported draft in ``draft_dir`` (target's embedding).

    ``shape`` (a :class:`SpecShape` or its name, e.g. ``tree4x4n12``), or ``num_steps`` for a chain of
    that depth; neither: the measured best shape (:func:`~eaglenest.speculative.tree.measured_best_shape`)."""
    from eaglenest.speculative.draft import check_export_matches, load_exported_drafter

    check_export_matches(draft_dir, runner.model_dir)
    draft = load_exported_drafter(draft_dir, embed_weight=runner.model.get_input_embeddings().weight,
                                  dtype=runner.model.dtype, target_aux_layer_ids=runner.aux_layer_ids)
    if shape is not None and num_steps is not None:
        raise ValueError("give shape or num_steps, not both")
    if isinstance(shape, str):
        shape = SpecShape.parse(shape)
    if shape is None:
        shape = SpecShape(depth=num_steps) if num_steps is not None else measured_best_shape()
    return SpecDecoder.eagle3(runner, draft, shape=shape, onednn=onednn)


def build_bench_engine(model_dir: str | Path, *, draft_dir: str | Path | None = None,
                       shape: SpecShape | str | None = None, dtype: str = "auto", onednn: str = "onednn"):
    """An embedded engine (no capture) serving greedy requests plainly or with EAGLE-3 (``shape``
    None: the measured best shape). The target, the drafter and their prepacked weights are made on the
    engine's scheduler thread, where they decode (:meth:`EmbeddedEngine.load` says why)."""
    from eaglenest.engines.embedded import EmbeddedEngine
    from eaglenest.speculative.draft import draft_aux_layer_ids

    policy = _policy(onednn)
    aux = draft_aux_layer_ids(draft_dir) if draft_dir else None

    def build() -> tuple[TargetRunner, Any]:
        runner = TargetRunner(model_dir, dtype=dtype, aux_layer_ids=aux)
        if draft_dir:
            return runner, SpecGreedy(load_spec_decoder(runner, draft_dir, shape=shape, onednn=policy))
        return runner, PlainGreedy(runner, policy)

    return EmbeddedEngine.load(build, capture_dir=None)


def _policy(name: str) -> OneDNN:
    options = OneDNN.candidates()
    if name not in options:
        raise ValueError(f"onednn={name!r}: choose one of {sorted(options)}")
    return options[name]


def bench_serve_command(*, model: str | Path, port: int, host: str = "127.0.0.1", draft: str | Path | None = None,
                        shape: SpecShape | None = None, dtype: str = "auto", onednn: str = "onednn",
                        threads: int | None = None) -> list[str]:
    """``python -m eaglenest bench serve ...``: the embedded benchmark server in a fresh process."""
    cmd = [sys.executable, "-m", "eaglenest", "bench", "serve", "--model", str(model), "--host", host,
           "--port", str(port), "--dtype", dtype, "--onednn", onednn]
    if threads:
        cmd += ["--threads", str(threads)]
    if not draft:
        return cmd
    # by name: SGLang's flags cannot say every shape (a confidence stop); none: the server's measured best shape
    return [*cmd, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
            *(["--speculative-shape", shape.name] if shape is not None else [])]
