"""Shared fixtures: a tiny random Llama (built once per session), runners and an in-thread server."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton's CPU interpreter for the verify kernel's tests (tests/engines/test_tree_verify.py). Triton reads the choice
# when it is imported, and the collection of other modules imports it first, so it is made here; only where no CUDA
# GPU is (there the device tests' SGLang servers, children of this process, must compile their kernels for real)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from eaglenest.testing.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def tiny_runner(tiny_model_dir):
    """fp32 runner: batched and single forwards agree to float rounding."""
    from eaglenest.engines.runtime import TargetRunner

    return TargetRunner(tiny_model_dir, dtype="float32")


@pytest.fixture
def capture_server(tiny_runner, tmp_path):
    """An embedded server with capture into tmp_path/'capture', on a background thread."""
    from eaglenest.engines.embedded import EmbeddedEngine
    from eaglenest.engines.serving import BackgroundServer

    engine = EmbeddedEngine(tiny_runner, capture_dir=tmp_path / "capture")
    with BackgroundServer(engine) as url:
        yield url, engine
    engine.close()


@pytest.fixture(scope="session")
def prefect_api():
    """One temporary Prefect API server (SQLite) for the whole test session (~10 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


# ---------------------------------------------------------------- extraction
@pytest.fixture
def capture_servers(tiny_runner):
    """Factory: ``start(capture_dir, n=1)`` -> [(url, engine)] of in-thread embedded servers sharing the
    session's tiny runner; all stopped at teardown. Set EAGLENEST_FAULTS (monkeypatch) before calling to
    inject faults (eaglenest/testing/faults.py)."""
    import contextlib

    from eaglenest.engines.embedded import EmbeddedEngine
    from eaglenest.engines.serving import BackgroundServer

    with contextlib.ExitStack() as stack:

        def start(capture_dir, n=1, settings=None):
            out = []
            for _ in range(n):
                engine = EmbeddedEngine(tiny_runner, capture_dir=capture_dir, settings=settings)
                stack.callback(engine.close)
                out.append((stack.enter_context(BackgroundServer(engine)), engine))
            return out

        yield start


@pytest.fixture
def tiny_extract_params(tiny_model_dir, tmp_path):
    """ExtractParams for ~20 real ShareGPT samples (first turns of the first 100 conversations that fit
    384 tokens) on the tiny model, with fast timeouts. limit=200, max_tokens=512 gives ~50 samples."""
    from eaglenest.extraction.config import ExtractParams

    return ExtractParams(recipe="capture", model=str(tiny_model_dir), limit=100, max_turns=1, max_tokens=384,
                         output_dir=str(tmp_path / "out"), extraction_id="t", batch_size=8, concurrency=4,
                         request_timeout_s=20, backoff_s=0.01, shard_wait_s=0.5, launch_timeout_s=60)
@pytest.fixture(scope="session")
def drafter_store(tiny_runner):
    """In-memory store (the store API) of 40 real captures of the tiny target: a chat prompt plus the
    target's own greedy answer (one batched generate), loss mask on the answer tokens."""
    import random

    import torch

    from eaglenest.store import StoreSample
    from eaglenest.testing.fake_store import MemoryStore

    rng = random.Random(0)
    tok = tiny_runner.tokenizer
    from pathlib import Path

    lines = [ln.strip() for ln in Path(os.__file__).read_text().splitlines() if len(ln.strip()) > 20]
    prompts = [tok.apply_chat_template([{"role": "user", "content": " ".join(rng.sample(lines, rng.randint(1, 3)))}],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for _ in range(40)]
    width, new = max(map(len, prompts)), 40
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + list(p) for p in prompts])  # left padding
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is many times faster on a busy 2-core machine
    try:
        with torch.no_grad():
            out = tiny_runner.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new,
                                             do_sample=False, min_new_tokens=new, pad_token_id=tok.pad_token_id)
        full = [list(p) + out[r, width : width + rng.randint(12, new)].tolist() for r, p in enumerate(prompts)]
        caps = tiny_runner.capture(full)
    finally:
        torch.set_num_threads(threads)
    samples = []
    for i, (p, seq, cap) in enumerate(zip(prompts, full, caps, strict=True)):
        mask = torch.tensor([0] * len(p) + [1] * (len(seq) - len(p)), dtype=torch.bool)
        samples.append(StoreSample(f"tiny-{i:03d}", torch.tensor(seq, dtype=torch.int32), mask,
                                   cap.aux_hidden, cap.final_hidden))
    return MemoryStore(samples, tiny_runner.provenance())


@pytest.fixture(scope="session")
def spec_tiny(tiny_model_dir, tiny_runner, tmp_path_factory):
    """(runner fp32, untrained drafter dir, fitted drafter dir, greedy sequences (prompt + 40 new), prompt lens)."""
    from spec_support import fit_drafter, greedy_sequences, one_thread, random_prompts

    from eaglenest.speculative.draft import write_random_draft

    root = tmp_path_factory.mktemp("spec")
    untrained = write_random_draft(tiny_model_dir, root / "untrained")
    fitted = write_random_draft(tiny_model_dir, root / "fitted")
    prompts = random_prompts(16, seed=11, lo=5, hi=25)
    with one_thread():
        seqs = greedy_sequences(tiny_runner, prompts, 40)
        fit_drafter(tiny_runner, fitted, seqs)
    return tiny_runner, untrained, fitted, seqs, [len(p) for p in prompts]
