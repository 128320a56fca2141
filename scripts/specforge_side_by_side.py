"""SpecForge's EAGLE-3 trainer and eaglenest's on the same store samples, and one evaluator for both exports.

Owns the side by side's settings, the sample selection, the store -> SpecForge offline-format converter, the
drivers of both trainers and the scorer; scripts/gpu_specforge.py is its command line and report. No Prefect.

SpecForge (PyPI ``specforge`` 0.2.0 installed with --no-deps; on the H200 it also needs ``datasets`` and
``multiprocess``) is driven through its library exactly as its one-process ``specforge train`` worker does:
a typed ``specforge.config.Config`` in offline mode (``data.hidden_states_path``), ``resolve_run`` and
``build_application_run`` (its FSDP backend, BF16Optimizer, threaded feature loader, Triton KL kernel) and
``TrainingRun.run()``; then ``specforge.export.to_sglang.export_to_sglang``.

Shared, so that the two trainers differ only in themselves:
- data: the first samples of the store's training split (eaglenest's split: 5% held out, at most 200) within
  --max-train-tokens, cut to a whole number of SpecForge optimizer steps; both train --epochs over them;
- SpecForge's offline format (what its prepare_hidden_states writes), written by our converter: one
  ``data_NNNNNN.ckpt`` (a torch.save dict) per sample: ``input_ids`` int64 [T], ``loss_mask`` int64 [T],
  ``hidden_state`` bf16 [1, T, H] (final_hidden: its TargetHead projects it, shifted by one, to the target
  distribution), ``aux_hidden_state`` bf16 [1, T, 3H] (aux_hidden). The mask is written shifted one to the left:
  SpecForge counts anchor t by loss_mask[t], eaglenest by loss_mask[t + 1] (the target's row), so both train on
  the same rows;
- the draft vocabulary (eaglenest's d2t/t2d of these samples, given to SpecForge as ``vocab_mapping_path``), the
  drafter's shape (our SGLang config is SpecForge's draft config), lr, warm-up steps, gradient clip 0.5, TTT 7
  with decay 0.8, bf16, max_seq_len and the tokens per optimizer step (SpecForge's batch_size x
  accumulation_steps = the mean number of samples in one eaglenest step of --max-tokens padded tokens);
- SpecForge's own recipe where it has no knob: AdamW betas (0.9, 0.999) (ours 0.95), cosine to 0 (ours to 0.1 lr),
  a step's KL averaged over all B x T positions (ours over counted rows), random batches padded to the longest.

Both exports are scored by one evaluator (eaglenest.drafter.evaluate: teacher-forced, accept length per verify
cycle) on the store's held-out split and every eval set (and any other exported drafter, e.g. a session's).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import socket
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eaglenest import contract
from eaglenest import models as model_lib
from eaglenest.atomic import atomic_write_bytes
from eaglenest.drafter.data import BatchStream, store_view
from eaglenest.drafter.export import export_drafter, sglang_config
from eaglenest.drafter.model import DrafterConfig
from eaglenest.drafter.train_state import HELDOUT, open_eval_sets, store_fingerprint
from eaglenest.drafter.vocab import build_draft_vocab, loss_tokens
from eaglenest.store import split_indices

FEATURES, SELECTION, VOCAB, DRAFT_CONFIG, TARGET_VIEW = (
    "features", "selection.json", "vocab_mapping.pt", "draft_config.json", "target")
SF_RUN, SF_EXPORT, EN_RUN, EN_EXPORT = "specforge-run", "specforge-export", "eaglenest-run", "eaglenest-export"


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """One side-by-side run (saved as WORK/settings.json and in the report)."""

    store: str
    target: str
    work: str
    max_train_tokens: int = 1_500_000  # samples kept (each cut to max_seq_len) while their tokens fit
    max_samples: int | None = None
    epochs: int = 2
    draft_vocab: int = 16000
    lr: float = 1e-3
    warmup_steps: int = 20
    max_tokens: int = 16384  # eaglenest's padded tokens per micro-batch: sets the tokens per step of both
    max_seq_len: int = 2048
    ttt_steps: int = 7
    sf_batch_size: int = 16  # SpecForge samples per micro-batch (at most); accumulation makes up the step
    sf_attention: str = "flex_attention"  # SpecForge's default backend ('sdpa' on CPUs)
    sf_sharding: str = "SHARD_GRAD_OP"  # its default; NO_SHARD (DDP) on CPUs, where FSDP cannot run
    sf_workers: int | None = None  # feature-loader threads (None: SpecForge's default, 4)
    eval_fraction: float = 0.05
    eval_max_samples: int = 200
    seed: int = 0
    device: str = "auto"
    check_sha256: bool = True  # sha256-check each store data file on its first read in this process

    def torch_device(self) -> torch.device:
        from eaglenest.models import auto_device

        return torch.device(auto_device(self.device))


@dataclass(frozen=True, kw_only=True, slots=True)
class Selection:
    """The samples both trainers see, and SpecForge's step shape."""

    indices: list[int]
    sample_ids: list[str]
    tokens: int  # per epoch, each sample cut to max_seq_len
    batch_size: int
    accumulation_steps: int
    eaglenest_steps_per_epoch: int

    @property
    def optimizer_steps(self) -> int:  # SpecForge's, per epoch
        return len(self.indices) // (self.batch_size * self.accumulation_steps)


def select_samples(store, s: Settings) -> Selection:
    """The first training-split samples within the token budget, cut to whole SpecForge optimizer steps."""
    train_idx, _ = split_indices(store.sample_ids, s.eval_fraction, max_eval=s.eval_max_samples)
    picked, tokens = [], 0
    for i in train_idx:
        n = min(int(store.num_tokens[i]), s.max_seq_len)
        if tokens + n > s.max_train_tokens or (s.max_samples is not None and len(picked) >= s.max_samples):
            break
        picked.append(i)
        tokens += n
    if not picked:
        raise contract.ContractError(f"no training sample fits --max-train-tokens {s.max_train_tokens}")
    lengths = [min(int(store.num_tokens[i]), s.max_seq_len) for i in picked]
    steps = BatchStream(lengths, max_tokens=s.max_tokens, seed=s.seed).batches_per_epoch()
    per_step = max(1, round(len(picked) / steps))
    # as few micro-batches as sf_batch_size allows, and samples per step as near eaglenest's as they can be
    # (on the H200: 19 a step had become 16 x 2 = 32, 1.7x the tokens per step and 0.6x the steps)
    accum = math.ceil(per_step / s.sf_batch_size)
    batch = max(1, round(per_step / accum))
    keep = len(picked) - len(picked) % (batch * accum)  # SpecForge drops an incomplete batch; drop it for both
    if keep == 0:
        raise contract.ContractError(f"{len(picked)} samples are fewer than one SpecForge step ({batch * accum})")
    picked = picked[:keep]
    return Selection(indices=picked, sample_ids=[store.sample_ids[i] for i in picked],
                     tokens=sum(lengths[:keep]), batch_size=batch, accumulation_steps=accum,
                     eaglenest_steps_per_epoch=steps)


# ---- SpecForge's offline format ---------------------------------------------------------------------------
def feature_record(sample, max_seq_len: int) -> dict[str, torch.Tensor]:
    """One store sample as SpecForge's offline feature dict (copies: store tensors are views of a whole file;
    an fp8 store's states are decoded to bf16, what our trainer reads from it too)."""
    n = min(int(sample.input_ids.numel()), max_seq_len)
    aux, final = sample.aux_hidden[:n], sample.final_hidden[:n]
    if not (contract.all_finite(aux) and contract.all_finite(final)):
        raise contract.ContractError(f"non-finite hidden states in sample {sample.sample_id!r}; re-validate the store")
    mask = sample.loss_mask[:n].to(torch.int64)
    shifted = torch.zeros_like(mask)  # [T] SpecForge's anchor t counts when eaglenest's row t + 1 does
    shifted[:-1] = mask[1:]
    return {"input_ids": sample.input_ids[:n].to(torch.int64).clone(), "loss_mask": shifted,
            "hidden_state": final.to(torch.bfloat16).clone().unsqueeze(0),  # [1, T, H]
            "aux_hidden_state": aux.to(torch.bfloat16).clone().unsqueeze(0)}  # [1, T, 3H]


def _save_torch(obj, path: Path) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())
    return buf.tell()


def target_view(target_dir: Path, out: Path) -> str:
    """A folder of links to the target plus a weights index; returns the LM head's tensor name.

    SpecForge's TargetHead finds the LM head only through a ``*.index.json`` (a one-file target such as SmolLM2
    has none) and a tied target has no ``lm_head.weight``: both are answered here without copying weights."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    names: dict[str, str] = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names.update(dict.fromkeys(fh.keys(), f.name))
    if not list(out.glob("*.index.json")):
        atomic_write_bytes(out / "model.safetensors.index.json",
                           json.dumps({"metadata": {}, "weight_map": names}).encode())
    tied = json.loads((target_dir / "config.json").read_text()).get("tie_word_embeddings")
    return "model.embed_tokens.weight" if tied or "lm_head.weight" not in names else "lm_head.weight"


def convert(store, s: Settings, sel: Selection) -> dict:
    """Features, vocabulary, draft config and target view under WORK; selection.json last (what makes it exist)."""
    work = Path(s.work)
    key = hashlib.sha256(json.dumps([store_fingerprint(store), sel.sample_ids, s.max_seq_len, s.draft_vocab,
                                     s.target]).encode()).hexdigest()
    manifest_path = work / SELECTION
    if manifest_path.is_file():
        done = json.loads(manifest_path.read_text())
        if done.get("key") == key and len(list((work / FEATURES).glob("*.ckpt"))) == len(sel.indices):
            return done  # present and valid: the same samples of the same store, every file there
    need = sum(int(store.num_tokens[i]) for i in sel.indices) * 2 * (1 + len(store.provenance.aux_layer_ids)) * (
        store.provenance.hidden_size)
    free = shutil.disk_usage(work if work.exists() else work.parent).free
    if need * 1.05 > free:
        raise contract.ContractError(f"{work}: the features need ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free; "
                                     "lower --max-train-tokens or free space")
    shutil.rmtree(work / FEATURES, ignore_errors=True)
    (work / FEATURES).mkdir(parents=True)
    t0 = time.perf_counter()
    if hasattr(store, "prefetch"):  # a Store maps (and sha256-checks) its data files once, in parallel
        store.prefetch(sel.indices)

    def write(j: int) -> int:
        rec = feature_record(store[sel.indices[j]], s.max_seq_len)
        return _save_torch(rec, work / FEATURES / f"data_{j:06d}.ckpt")

    with ThreadPoolExecutor(8) as pool:
        nbytes = sum(pool.map(write, range(len(sel.indices))))
    seconds = time.perf_counter() - t0
    target_dir = model_lib.resolve_model(s.target)
    tcfg = json.loads((target_dir / "config.json").read_text())
    vocab = build_draft_vocab(loss_tokens(store, sel.indices), vocab_size=int(tcfg["vocab_size"]),
                              size=s.draft_vocab)
    _save_torch({"d2t": vocab.d2t, "t2d": vocab.t2d}, work / VOCAB)
    dcfg = DrafterConfig.from_target(tcfg, aux_layer_ids=tuple(store.provenance.aux_layer_ids),
                                     draft_vocab_size=vocab.size)
    atomic_write_bytes(work / DRAFT_CONFIG, json.dumps(sglang_config(dcfg), indent=1).encode())
    lm_head_key = target_view(target_dir, work / TARGET_VIEW)
    done = {"key": key, "samples": len(sel.indices), "tokens": sel.tokens, "bytes": nbytes, "seconds": seconds,
            "vocab_coverage": vocab.coverage, "lm_head_key": lm_head_key, "selection": asdict(sel),
            "loss_mask": "shifted left by one (SpecForge counts anchor t by mask[t]; eaglenest by mask[t + 1])"}
    atomic_write_bytes(manifest_path, json.dumps(done).encode())
    return done


# ---- SpecForge's trainer ----------------------------------------------------------------------------------
def specforge_config(s: Settings, sel: Selection, lm_head_key: str) -> dict:
    """The typed config SpecForge's `specforge train --config` would read, with the shared settings."""
    work = Path(s.work).resolve()
    total = sel.optimizer_steps * s.epochs
    warmup = min(s.warmup_steps, total - 1)  # its cosine scheduler divides by (total - warm-up) steps
    data = {"hidden_states_path": str(work / FEATURES), "max_length": s.max_seq_len, "cache_dir": str(work / "cache")}
    if s.sf_workers is not None:
        data["dataloader_num_workers"] = s.sf_workers
    return {
        "model": {"target_model_path": str(work / TARGET_VIEW), "draft_model_config": str(work / DRAFT_CONFIG),
                  "vocab_mapping_path": str(work / VOCAB), "lm_head_key": lm_head_key, "torch_dtype": "bfloat16"},
        "data": data,
        "training": {"num_epochs": s.epochs, "batch_size": sel.batch_size, "accumulation_steps": sel.accumulation_steps,
                     "learning_rate": s.lr, "lr_scheduler": "cosine", "max_grad_norm": 0.5,
                     "warmup_ratio": (warmup + 0.5) / total, "ttt_length": s.ttt_steps,
                     "attention_backend": s.sf_attention, "fsdp_sharding": s.sf_sharding, "log_interval": 10,
                     "save_interval": 0, "seed": s.seed},
        "run_id": "specforge", "output_dir": str(work / SF_RUN),
    }


def _single_process_env() -> None:
    """The torchrun variables of a one-process run (what `specforge train` sets for a direct call)."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)


def _datasets_importable() -> str:
    """SpecForge's offline collator module imports ``datasets`` for a type annotation only. Where that package
    cannot be imported (the H200 image lacks it; we carry a wheel), a stand-in holding that one name lets the
    run go on; the report says which happened."""
    try:
        import datasets

        return f"datasets {datasets.__version__}"
    except ImportError as e:
        stand_in = types.ModuleType("datasets")
        stand_in.Dataset = type("Dataset", (), {})
        sys.modules["datasets"] = stand_in
        return f"stand-in (import failed: {e})"


def train_specforge(config: dict, *, mean_tokens: float) -> dict:
    """SpecForge's one-process offline run; times assembly and fit; the log's windows give the steady rate."""
    datasets_used = _datasets_importable()
    from accelerate.utils import set_seed
    from specforge.application import build_application_run, resolve_run
    from specforge.config import Config
    from specforge.distributed import destroy_distributed, init_distributed
    from specforge.training import assembly

    cfg = Config.model_validate(config)
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a fresh run: SpecForge would rewind into an old folder
    _single_process_env()
    os.environ["FSDP_SHARDING"] = cfg.training.fsdp_sharding  # its backend reads the sharding from here
    set_seed(cfg.training.seed)
    windows: list[dict] = []
    printer = assembly._logger  # the run's metrics sink when no tracker is configured: recorded, then printed

    def record(metrics, step):
        windows.append({"step": step, **{k: float(metrics[k]) for k in ("loss", "acc", "lr",
                                                                         "perf/global_samples_per_second")
                                         if k in metrics}})
        printer(metrics, step)

    assembly._logger = record
    init_distributed(timeout=cfg.training.dist_timeout)
    try:
        t0 = time.perf_counter()
        run = build_application_run(resolve_run(cfg))
        t1 = time.perf_counter()
        steps = run.run()
        t2 = time.perf_counter()
    finally:
        assembly._logger = printer
        destroy_distributed()
    tokens = mean_tokens * steps * cfg.training.batch_size * cfg.training.accumulation_steps
    rates = [w["perf/global_samples_per_second"] for w in windows[1:] if "perf/global_samples_per_second" in w]
    return {"steps": steps, "tokens": round(tokens), "setup_s": t1 - t0, "fit_s": t2 - t1, "datasets": datasets_used,
            "tokens_per_s": tokens / max(t2 - t1, 1e-9),
            "steady_tokens_per_s": (sum(rates) / len(rates) * mean_tokens) if rates else None, "log": windows}


def export_specforge(work: Path) -> Path:
    """SpecForge's own SGLang export of its latest checkpoint, checked by our SGLang-format reader."""
    import importlib.metadata

    from specforge.export.to_sglang import export_to_sglang

    from eaglenest.speculative.draft import read_draft_config

    out, tmp = work / SF_EXPORT, work / f"{SF_EXPORT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    export_to_sglang(str(work / SF_RUN), str(work / DRAFT_CONFIG), str(tmp), vocab_mapping_path=str(work / VOCAB))
    read_draft_config(tmp)  # architectures, eagle_config aux ids: what SGLang and our loader need
    source = {"trainer": "specforge", "version": importlib.metadata.version("specforge"),
              "selection": json.loads((work / SELECTION).read_text())["key"]}
    atomic_write_bytes(tmp / "specforge.json", json.dumps(source).encode())
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# ---- eaglenest's trainer on the same samples --------------------------------------------------------------
def train_eaglenest(store, s: Settings, sel: Selection) -> dict:
    from eaglenest.drafter.config import TrainConfig
    from eaglenest.drafter.train import train

    work = Path(s.work)
    shutil.rmtree(work / EN_RUN, ignore_errors=True)  # a fresh run (an old checkpoint would be resumed)
    cfg = TrainConfig(store=s.store, out_dir=str(work / EN_RUN), target=s.target, draft_vocab_size=s.draft_vocab,
                      ttt_steps=s.ttt_steps, epochs=float(s.epochs), max_tokens=s.max_tokens, max_seq_len=s.max_seq_len,
                      lr=s.lr, warmup_steps=s.warmup_steps, eval_fraction=0.0, eval_every=0, save_every=10**9,
                      log_every=50, device=s.device, seed=s.seed)
    steps: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    res = train(cfg, store=store_view(store, sel.indices),
                callback=lambda e: steps.append((time.perf_counter(), e["tokens"])) if e["kind"] == "train" else None)
    t1 = time.perf_counter()
    export_drafter(work / EN_RUN, work / EN_EXPORT, overwrite=True)
    warm = steps[len(steps) // 10 :]  # the first tenth of the steps warms up (allocator, kernels)
    steady = (sum(n for _, n in warm[1:]) / (warm[-1][0] - warm[0][0])) if len(warm) > 2 else None
    return {"steps": res.step, "tokens": res.train_tokens, "setup_s": t1 - t0 - res.train_seconds,
            "fit_s": res.train_seconds, "tokens_per_s": res.tokens_per_s, "steady_tokens_per_s": steady}


# ---- one evaluator for every drafter ----------------------------------------------------------------------
def score(store, s: Settings, drafts: dict[str, Path], eval_sets: dict[str, str]) -> dict:
    """Teacher-forced TTT metrics of each exported drafter on the held-out split and every eval set."""
    from eaglenest.drafter.evaluate import evaluate
    from eaglenest.drafter.target import load_target_tensors
    from eaglenest.speculative.draft import load_exported_drafter

    device = s.torch_device()
    bf16 = model_lib.auto_dtype(device.type) == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    target_dir = model_lib.resolve_model(s.target)
    tt = load_target_tensors(target_dir)
    head = tt.lm_head.to(device=device, dtype=dtype)
    _, heldout = split_indices(store.sample_ids, s.eval_fraction, max_eval=s.eval_max_samples)
    extra = open_eval_sets(eval_sets, store.provenance, target_dir)
    sets = [(HELDOUT, store, heldout)] + [(name, st, list(range(min(len(st), s.eval_max_samples))))
                                          for name, st in extra.items()]
    out: dict[str, dict] = {}
    for name, folder in drafts.items():
        model = load_exported_drafter(folder, embed_weight=tt.embed.to(dtype), dtype=dtype,
                                      target_aux_layer_ids=store.provenance.aux_layer_ids).to(device)
        out[name] = {}
        for set_name, st, idx in sets:
            autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
            res = evaluate(model, st, idx, head_full=head, k=s.ttt_steps, max_tokens=s.max_tokens,
                           max_seq_len=s.max_seq_len, dtype=dtype, autocast=autocast)
            out[name][set_name] = res.to_dict()
    return out
