"""Helpers for the speculative-decoding tests: prompts, greedy references, a drafter fitted in seconds.

The fitted drafter lets the tiny random target exercise every accept length through the real EAGLE-3
path: its greedy continuations are short loops that one draft layer memorizes quickly.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


@contextlib.contextmanager
def one_thread():
    """Tiny models on a shared 2-core machine run ~10x faster on one thread (no OpenMP contention)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def random_prompts(n: int, *, seed: int = 0, lo: int = 3, hi: int = 30, vocab: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (t,), generator=g).tolist() for t in lengths]


def greedy_sequences(runner, prompts, new_tokens: int) -> list[list[int]]:
    from eaglenest.speculative.decoder import plain_greedy

    return [p + plain_greedy(runner, p, max_new_tokens=new_tokens, ignore_eos=True).output_ids for p in prompts]


def fit_drafter(runner, draft_dir: Path, sequences: list[list[int]], *, steps: int = 80, lr: float = 1e-2) -> None:
    """Train the drafter in ``draft_dir`` (step-1 cross entropy on the target's greedy tokens), save in place."""
    from safetensors.torch import save_file

    from eaglenest.speculative.draft import load_exported_drafter

    draft = load_exported_drafter(draft_dir, embed_weight=runner.model.get_input_embeddings().weight,
                                  target_aux_layer_ids=runner.aux_layer_ids)
    caps = runner.capture(sequences)
    b, t = len(sequences), max(map(len, sequences))
    x = torch.zeros(b, t, dtype=torch.long)  # [B, T]
    aux = torch.zeros(b, t, caps[0].aux_hidden.shape[1])  # [B, T, 3H]
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, (s, c) in enumerate(zip(sequences, caps, strict=True)):
        x[i, : len(s)], aux[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), c.aux_hidden.float(), True
    pos = torch.arange(t - 1).expand(b, -1)  # [B, T-1]
    params = list(draft.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        logits = draft.extend(x[:, 1:], aux[:, : t - 1], pos).logits[:, : t - 2]  # predicts x[:, 2:]
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 2:]], x[:, 2:][mask[:, 2:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: v.detach().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})


def level(c, tok_s, accept=None, errors=0):
    """A synthetic level result."""
    from eaglenest.speculative.loadgen import LevelResult

    return LevelResult(concurrency=c, requests=8, errors=errors, duration_s=1.0, output_tokens=int(tok_s),
                       output_tok_s=tok_s, requests_per_s=8.0, latency_mean_s=0.5, latency_p50_s=0.5,
                       latency_p90_s=0.8, latency_p99_s=0.9, accept_length=accept,
                       first_error="HTTP 500" if errors else None)


def report(base, eagle, **kw):
    """A synthetic SGLang benchmark report (baseline levels, EAGLE3 levels)."""
    from eaglenest.speculative.live import ServerResult
    from eaglenest.speculative.report import BenchReport

    return BenchReport(engine="sglang", model="/m/SmolLM2", draft="/d", spec={"num_steps": 3, "topk": 1,
                       "num_draft_tokens": 4}, prompt_set="mt-bench", prompt_source="pkg", num_prompts=80,
                       max_new_tokens=256, baseline=ServerResult(name="baseline", cmd=["a"], levels=base,
                                                                 server_accept_length=None, startup_s=1.0),
                       eagle3=ServerResult(name="eagle3", cmd=["b"], levels=eagle, server_accept_length=2.9,
                                           startup_s=2.0), **kw)
