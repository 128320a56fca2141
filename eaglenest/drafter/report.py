"""Training report: the loss curve PNG and a summary table from a run folder's metrics.jsonl.

Owns reading ``metrics.jsonl`` (append-only; after a resume, re-done steps are appended again and the
LAST record of each (kind, step) wins, which is exactly the resumed run's history) and plotting it.
"""

from __future__ import annotations

import json
from pathlib import Path

from eaglenest.atomic import atomic_write_bytes

HELDOUT = "heldout"  # the set name of the training store's own held-out split (older runs wrote none)


def read_metrics(run_dir: str | Path) -> dict[str, list[dict]]:
    """{"train": [...], "eval": [held-out...], "eval:<set>": [...] per extra eval set}, each sorted by
    step, last record per step."""
    path = Path(run_dir) / "metrics.jsonl"
    latest: dict[tuple[str, int], dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a torn last line
                continue
            if rec.get("kind") == "train":
                latest[("train", int(rec["step"]))] = rec
            elif rec.get("kind") == "eval":
                name = rec.get("set", HELDOUT)
                latest[("eval" if name == HELDOUT else f"eval:{name}", int(rec["step"]))] = rec
    out: dict[str, list[dict]] = {"train": [], "eval": []}
    for (kind, _), rec in sorted(latest.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault(kind, []).append(rec)
    return out


def shown_depths(depths: list[int]) -> list[int]:
    """The accept-length depths a panel draws: 1, 2, 3 and the deepest, each once, those that exist."""
    return sorted({d for d in (1, 2, 3, max(depths)) if d in depths}) if depths else []


def _points(evs: list[dict], d: int) -> tuple[list[int], list[float]]:
    """(steps, accept lengths) at depth ``d`` of the evals that scored it (a run resumed with another eval_steps
    holds evals of different depths)."""
    at = [e for e in evs if str(d) in e["accept_length"]]
    return [e["step"] for e in at], [e["accept_length"][str(d)] for e in at]


def draw_accept_lengths(ax, m: dict[str, list[dict]]) -> list[str]:
    """Held-out accept length per shown depth, and each eval set's at depth 3 (dashed); returns the labels."""
    labels = []
    evs = m.get("eval") or []
    if evs:
        for d in shown_depths(sorted(int(x) for x in evs[-1]["accept_length"])):
            ax.plot(*_points(evs, d), marker="o", label=f"held-out depth {d}")
            labels.append(f"held-out depth {d}")
    for kind in sorted(k for k in m if k.startswith("eval:")):
        evs = m[kind]
        d = min(3, max(int(x) for x in evs[-1]["accept_length"]))
        ax.plot(*_points(evs, d), ls="--", marker="s", label=f"{kind[5:]} depth {d}")
        labels.append(f"{kind[5:]} depth {d}")
    if labels:
        ax.legend(loc="lower right")
    return labels


def plot_loss_curve(run_dir: str | Path, png: str | Path | None = None) -> Path:
    """Loss (and LR) per step with held-out accept length at each eval; written atomically."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = read_metrics(run_dir)
    png = Path(png) if png else Path(run_dir) / "loss_curve.png"
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if m["train"]:
        steps = [r["step"] for r in m["train"]]
        ax.plot(steps, [r["loss"] for r in m["train"]], lw=1, label="TTT loss (weighted KL)")
        ax.set_yscale("log")
        lr_ax = ax.twinx()
        lr_ax.plot(steps, [r["lr"] for r in m["train"]], color="grey", lw=0.8, ls="--", label="lr")
        lr_ax.set_ylabel("learning rate")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.legend(loc="upper right")
    draw_accept_lengths(ax2, m)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("simulated accept length (bonus incl.)")
    ax2.set_title("accept length (held-out and eval sets)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    png.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(png, buf.getvalue())
    return png


def summary_rows(result: dict) -> list[dict]:
    """Rows for a table artifact: status, steps, tokens, speed and the last held-out metrics."""
    ev = result.get("eval") or {}
    rows = [{"metric": k, "value": result.get(k)} for k in ("status", "step", "total_steps", "train_tokens",
                                                             "elapsed_s", "tokens_per_s")]
    for d, v in (ev.get("accept_length") or {}).items():
        rows.append({"metric": f"held-out accept length @ depth {d}", "value": round(v, 4)})
    for i, a in enumerate(ev.get("step_acc") or []):
        rows.append({"metric": f"held-out step-{i} accuracy", "value": round(a, 4)})
    for name, es in (result.get("eval_sets") or {}).items():
        for d, v in (es.get("accept_length_cycles") or {}).items():
            rows.append({"metric": f"{name} accept length per cycle @ depth {d}", "value": round(v, 4)})
    if result.get("note"):
        rows.append({"metric": "stopped because", "value": result["note"]})
    return rows


def eval_curves(run_dir: str | Path) -> dict[str, list[dict]]:
    """Per eval set ('heldout' and each extra set): [{step, train_tokens, accept_length, accept_length_cycles}]
    in step order; train_tokens comes from the eval record (or the cumulative train records before it)."""
    m = read_metrics(run_dir)
    seen, cum = 0, {}
    for r in m["train"]:
        seen += int(r.get("tokens", 0))
        cum[int(r["step"])] = seen
    out = {}
    for kind, evs in m.items():
        if kind != "eval" and not kind.startswith("eval:"):
            continue
        name = HELDOUT if kind == "eval" else kind[5:]
        out[name] = [{"step": e["step"], "train_tokens": e.get("train_tokens", cum.get(int(e["step"]), 0)),
                      "accept_length": e["accept_length"], "accept_length_cycles": e.get("accept_length_cycles", {})}
                     for e in evs]
    return out


def plot_sweep(curves: dict[str, dict[str, list[dict]]], png: str | Path, depths: tuple[int, ...] = (3, 7)) -> Path:
    """One panel per eval set: accept length per verify cycle (what live decoding reports) against training
    tokens, one colour per config, solid/dashed per depth. ``curves``: {config: eval_curves(run)}."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({s for c in curves.values() for s in c}, key=lambda s: (s != HELDOUT, s))
    fig, axes = plt.subplots(1, max(1, len(sets)), figsize=(5.5 * max(1, len(sets)), 4.2), squeeze=False)
    styles = ("-", "--", ":", "-.")
    for ax, name in zip(axes[0], sets, strict=False):
        for ci, (cfg, c) in enumerate(sorted(curves.items())):
            pts = c.get(name) or []
            for di, d in enumerate(depths):
                ys = [(p["train_tokens"], (p["accept_length_cycles"] or p["accept_length"]).get(str(d))) for p in pts]
                ys = [(x, y) for x, y in ys if y is not None]
                if ys:
                    ax.plot([x / 1e6 for x, _ in ys], [y for _, y in ys], styles[di % 4], color=f"C{ci % 10}",
                            marker="o", ms=3, label=f"{cfg} @{d}")
        ax.set_title(f"{name}: accept length per verify cycle")
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("accept length (bonus incl.)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(png, buf.getvalue())
    return png
