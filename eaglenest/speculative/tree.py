"""Draft trees for the embedded decoder: the speculation shape, the tree, its verify mask, acceptance.

Owns what a cycle drafts and how the target checks it, independent of which model drafts:

- :class:`SpecShape`: ``depth`` draft forwards per cycle, ``topk`` candidates per expanded node, and
  ``draft_tokens`` tree nodes verified (the root excluded). ``topk == 1`` is a chain of ``depth``
  tokens (SGLang ``--speculative-eagle-topk 1``), or with ``min_prob`` a chain that stops drafting where
  the drafter's confidence falls (1..``depth`` tokens per cycle, embedded decoder only); otherwise
  EAGLE-2's dynamic tree (SGLang's ``--speculative-eagle-topk`` > 1 with
  ``--speculative-num-draft-tokens = draft_tokens + 1``).
- :class:`DraftTree`: nodes in an order where a parent precedes its children (node ``i``'s parent
  is ``parents[i]``, ``-1`` = the root); a chain is ``parents == [-1, 0, 1, ...]``.
- :func:`verify_inputs`: the verify forward's tokens, position ids and a 4-D boolean mask
  (True = attend) over ``[cache..., root, nodes...]``: every row sees the whole cache, its
  ancestors and itself, so one forward scores every root-to-node path at once.
- :func:`accept`: greedy acceptance of the longest path whose every token is the target's argmax
  after its parent (the bonus token is the target's argmax after the last accepted node).

Invariant: the emitted tokens are the target's greedy choices along one path; each row's logits
depend only on its ancestors, so the result equals sequential greedy decoding in exact arithmetic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglenest.atomic import atomic_write_bytes
from eaglenest.speculative.kernels import cpu_class
from eaglenest.speculative.quant import QUANTS

PROB_DECIMALS = 10


def _decimal(p: float) -> str:
    """``p`` in [0, 1) as a plain decimal without trailing zeros (0.35, 0.00001: never an exponent)."""
    return f"{p:.{PROB_DECIMALS}f}".rstrip("0")


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecShape:
    """What one speculation cycle drafts (SGLang's flags in brackets)."""

    depth: int = 3
    """Draft forwards per cycle and the longest path [--speculative-num-steps]."""
    topk: int = 1
    """Candidates kept per expanded node and nodes expanded per depth [--speculative-eagle-topk]."""
    draft_tokens: int | None = None
    """Tree nodes verified, root excluded (SGLang's --speculative-num-draft-tokens minus one); default
    and only value for a chain: ``depth``."""
    min_prob: float = 0.0
    """Chains only (no SGLang flag): draft the next token only while the product of the draft
    probabilities of the tokens drafted so far is at least this, so a cycle drafts 1..``depth`` tokens;
    the first costs no draft forward and is always proposed. 0: always ``depth``."""
    quant: str = ""
    """Embedded decoder only (no SGLang flag; the name's suffix): the storage of the drafter's linear weights,
    ``""`` its own dtype, ``q8`` int8 with one scale per output row (half the bytes a bf16 draft forward
    streams) or ``q4`` int4 with one scale per group of 64 inputs (a quarter); see
    :mod:`~eaglenest.speculative.quant`. Only the drafts can change; the target verifies them, so the output is
    still the target's greedy decoding."""

    def __post_init__(self) -> None:
        if self.quant not in ("", *QUANTS):
            raise ValueError(f"quant={self.quant!r}: expected '' (the drafter's own dtype) or one of "
                             f"{', '.join(QUANTS)}")
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"depth and topk must be >= 1, got depth={self.depth} topk={self.topk}")
        if not 0.0 <= self.min_prob < 1.0 or (self.min_prob and (self.topk != 1 or self.depth < 2)):
            raise ValueError(f"min_prob={self.min_prob} must be in [0, 1), and only a chain (topk=1) of depth >= 2 "
                             "stops by it")
        if float(_decimal(self.min_prob)) != self.min_prob:
            raise ValueError(f"min_prob={self.min_prob}: at most {PROB_DECIMALS} decimals (it is part of the name)")
        n, most = self.nodes, self.topk + (self.depth - 1) * self.topk * self.topk
        if self.topk == 1 and n != self.depth:
            raise ValueError(f"a chain (topk=1) verifies depth={self.depth} draft tokens, not {n}")
        if not 1 <= n <= most:
            raise ValueError(f"draft_tokens={n} must be in [1, topk + (depth-1)*topk^2 = {most}]")

    @property
    def nodes(self) -> int:
        return self.draft_tokens if self.draft_tokens is not None else self.depth

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def name(self) -> str:
        if not self.is_chain:
            return f"tree{self.depth}x{self.topk}n{self.nodes}{self.quant}"
        return f"chain{self.depth}" + (f"p{_decimal(self.min_prob)}" if self.min_prob else "") + self.quant

    @classmethod
    def parse(cls, text: str) -> SpecShape:
        """``chain3``, ``chain5p0.4`` (at most 5 drafts, stopped below a draft probability of 0.4) or
        ``tree4x4n12`` (depth x topk, n nodes), each optionally ending in ``q8`` or ``q4`` (int8 or int4 drafter
        weights), as :attr:`name` writes them."""
        m = re.fullmatch(r"(?:chain(\d+)(?:p(0?\.\d+))?|tree(\d+)x(\d+)n(\d+))(" + "|".join(QUANTS) + ")?",
                         text.strip())
        if not m:
            raise ValueError(f"speculation shape {text!r}: expected chainD, chainDpP (P in (0, 1)) or treeDxKnN, "
                             f"optionally ending in {' or '.join(QUANTS)} (e.g. chain3, chain5p0.4, tree4x4n12, "
                             "chain2q8, chain3q4)")
        quant = m.group(6) or ""
        if m.group(1):
            if m.group(2) is not None and not float(m.group(2)):
                raise ValueError(f"speculation shape {text!r}: a stop probability must be in (0, 1)")
            return cls(depth=int(m.group(1)), min_prob=float(m.group(2) or 0.0), quant=quant)
        return cls(depth=int(m.group(3)), topk=int(m.group(4)), draft_tokens=int(m.group(5)), quant=quant)

    def to_json(self) -> dict:
        return {"name": self.name, "depth": self.depth, "topk": self.topk, "draft_tokens": self.nodes,
                **({"min_prob": self.min_prob} if self.min_prob else {}),
                **({"quant": self.quant} if self.quant else {})}


@dataclass(frozen=True, slots=True)
class DraftTree:
    tokens: list[int]
    """Target token id of each node."""
    parents: list[int]
    """Parent node index of each node (-1: the root); parents[i] < i."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"bad draft tree: tokens {self.tokens}, parents {self.parents}")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node (children of the root: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out


def verify_inputs(root: int, tree: DraftTree, past: int, *, device: torch.device | str = "cpu"):
    """(input_ids [1, N+1], position_ids [1, N+1], mask [1, 1, N+1, past+N+1] bool or None for a chain)
    of the verify forward over ``[root, nodes...]`` after ``past`` cached tokens."""
    ids = torch.tensor([[root, *tree.tokens]], device=device)
    n = len(tree) + 1
    if tree.is_chain:
        return ids, None, None  # plain causal attention: the model's own mask and positions
    depths = [0, *tree.depths()]
    pos = torch.tensor([[past + d for d in depths]], device=device)
    block = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(tree.parents, start=1):
        block[i] |= block[p + 1]  # a node sees what its parent sees (parents come first)
    mask = torch.cat((torch.ones(n, past, dtype=torch.bool), block), dim=1)[None, None].to(device)
    return ids, pos, mask


def accept(tree: DraftTree, target: Sequence[int]) -> tuple[list[int], int]:
    """Longest accepted path: (node indices root to leaf, bonus token). ``target[j]`` is the target's
    argmax after row j of the verify forward (row 0: the root, row i + 1: node i)."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        children.setdefault(p, {}).setdefault(tok, i)  # duplicate siblings: the first wins
    path: list[int] = []
    cur = -1
    while (nxt := children.get(cur, {}).get(target[cur + 1])) is not None:
        path.append(nxt)
        cur = nxt
    return path, int(target[cur + 1])


BEST_SHAPE_FILE = Path(__file__).with_name("cpu_shape.json")
"""The shapes the embedded decoder uses by default, one per kind of CPU
(:func:`~eaglenest.speculative.kernels.cpu_class`: ``{"by_cpu": {"amx": {...}, "no-amx": {...}}}``): the fastest
one ``scripts/bench_spec_cpu.py --shapes ... --save-shape`` measured on such a CPU (each entry names its run:
command, drafter, date, numbers)."""


def measured_best_shape(path: Path = BEST_SHAPE_FILE, cpu: str | None = None) -> SpecShape:
    """The default speculation shape of the embedded decoder on this kind of CPU (``cpu``: this machine's class);
    a kind never measured takes another kind's shape."""
    try:
        by_cpu = json.loads(path.read_text())["by_cpu"]
        entry = by_cpu.get(cpu or cpu_class()) or next(iter(by_cpu.values()))
        return SpecShape.parse(entry["shape"])
    except (OSError, KeyError, TypeError, ValueError, StopIteration, AttributeError) as e:
        raise ValueError(f"{path}: no readable best speculation shape ({e!r}); run scripts/bench_spec_cpu.py "
                         "--shapes ... --save-shape") from None


def save_best_shape(shape: SpecShape, evidence: dict, path: Path = BEST_SHAPE_FILE, cpu: str | None = None) -> Path:
    """Make ``shape`` the default on this kind of CPU (``cpu``: this machine's class), keeping the other kinds'."""
    by_cpu: dict = {}
    if path.exists():
        try:
            by_cpu = dict(json.loads(path.read_text())["by_cpu"])
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a file of best shapes ({e!r}); move it aside to start a new one") from None
    by_cpu[cpu or cpu_class()] = {"shape": shape.name, **shape.to_json(), "measured": evidence}
    atomic_write_bytes(path, (json.dumps({"by_cpu": dict(sorted(by_cpu.items()))}, indent=1) + "\n").encode())
    return path
