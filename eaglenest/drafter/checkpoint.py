"""Training checkpoints: atomic, rotated, and resumable exactly.

Owns the on-disk layout of a run's checkpoints::

    <run>/checkpoints/step-00000120/   model.safetensors  (drafter weights + d2t/t2d, fp32)
                                       optimizer.pt       (torch.save, loaded with weights_only=True)
                                       trainer.pt         (scheduler, data stream position, RNG states)
                                       state.json         (step, configs, provenance, history) - LAST
    <run>/checkpoints/LATEST           name of the newest complete checkpoint (atomic replace)

Invariants: a checkpoint folder is built under ``step-N.tmp-<random>`` (every file fsynced, then
the folder renamed, then the parent fsynced) and only then named in ``LATEST``; a crash at any
moment leaves ``LATEST`` naming a complete checkpoint (or none); temporaries are invisible to
readers and removed on the next start; at least ``keep`` (>= 2) complete checkpoints are kept and
the one ``LATEST`` names is never deleted. Nothing is unpickled beyond ``weights_only`` loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglenest import contract
from eaglenest.atomic import atomic_write_bytes, fsync_dir

_STEP_DIR = re.compile(r"^step-(\d{8})$")
LATEST = "LATEST"


class CheckpointError(contract.ContractError):
    """A checkpoint cannot be used (missing, incomplete, or from an incompatible run). Terminal."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict
    trainer: dict
    state: dict


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class CheckpointManager:
    def __init__(self, run_dir: str | Path, *, keep: int = 2) -> None:
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (got {keep}): the previous checkpoint guards a torn save")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def clean_temporaries(self) -> int:
        n = 0
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                if ".tmp-" in p.name:
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                    n += 1
        return n

    def complete(self) -> list[Path]:
        """Complete checkpoint folders, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if _STEP_DIR.match(p.name) and (p / "state.json").is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        pointer = self.dir / LATEST
        if pointer.is_file():
            path = self.dir / pointer.read_text().strip()
            if (path / "state.json").is_file():
                return path
        done = self.complete()  # LATEST lost or stale: fall back to the newest complete folder
        return done[-1] if done else None

    def save(self, *, step: int, model: dict[str, torch.Tensor], optimizer: dict, trainer: dict,
             state: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:08d}"
        tmp = self.dir / f"{name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        save_file({k: v.detach().contiguous().cpu() for k, v in model.items()}, str(tmp / "model.safetensors"))
        torch.save(optimizer, tmp / "optimizer.pt")
        torch.save(trainer, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps(dict(state, step=step), indent=1, sort_keys=True))
        for f in tmp.iterdir():
            _fsync_file(f)
        fsync_dir(tmp)
        final = self.dir / name
        self._commit(tmp, final)
        atomic_write_bytes(self.dir / LATEST, name.encode())
        self._rotate(final)
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        if final.exists():  # a re-save of the same step (resumed run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.dir)

    def _rotate(self, newest: Path) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep)]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path | None = None) -> Checkpoint:
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no complete checkpoint under {self.dir}")
        try:
            state = json.loads((path / "state.json").read_text())
            model = load_file(str(path / "model.safetensors"))
            optimizer = torch.load(path / "optimizer.pt", weights_only=True)
            trainer = torch.load(path / "trainer.pt", weights_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: unreadable checkpoint ({e}); delete it to fall back to the previous") from e
        bad = [k for k, v in model.items() if v.is_floating_point() and not contract.all_finite(v)]
        if bad:
            raise CheckpointError(f"{path}: non-finite weights in {bad}")
        return Checkpoint(path=path, step=int(state["step"]), model=model, optimizer=optimizer, trainer=trainer,
                          state=state)


def config_drift(saved: dict, current: dict, *, mutable: frozenset[str]) -> list[str]:
    """Fields whose values differ between a checkpoint's config and the current one (mutable ignored)."""
    keys = (set(saved) | set(current)) - mutable
    return sorted(k for k in keys if saved.get(k) != current.get(k))


def describe_drift(saved: dict, current: dict, fields: list[str]) -> str:
    return "; ".join(f"{f}: checkpoint {saved.get(f)!r}, now {current.get(f)!r}" for f in fields)
