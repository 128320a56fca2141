"""scripts/gpu_session.sh's drafter resolution, run by bash on its own function (no GPU, no device kit)."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_session.sh"


def resolve(arg: str) -> subprocess.CompletedProcess:
    """``resolve_draft ARG`` alone (sourced from the script), printing the folder and name it settles on."""
    prog = (f'source <(sed -n "/^resolve_draft()/,/^}}/p" "{SCRIPT}"); resolve_draft "$1"; '
            'echo "draft=$draft name=$name"')
    return subprocess.run(["bash", "-c", prog, "bash", arg], capture_output=True, text=True, timeout=30)


def test_a_drafter_folder_path_resolves_to_itself(tmp_path):
    folder = tmp_path / "n18-t16000"
    folder.mkdir()
    out = resolve(str(folder))
    assert out.returncode == 0 and out.stdout.strip() == f"draft={folder} name=n18-t16000"


def test_a_train_calls_name_is_looked_up_under_the_exports():
    out = resolve("n19-t16000x")  # (no folder of that name here, nor a NAME-tN to trim: the name passes through)
    assert out.returncode == 0 and out.stdout.strip() == "draft=/tmp/export/n19-t16000x name=n19-t16000x"


def test_a_path_that_is_no_folder_is_refused_by_name(tmp_path):
    """2026-12-07f: DRAFTERS=/tmp/init-drafter/NAME before any parts:NAME call ran the grid on
    /tmp/export//tmp/init-drafter/NAME; now it stops, saying how carried parts are unpacked."""
    missing = tmp_path / "init-drafter" / "n18-t16000"
    out = resolve(str(missing))
    assert out.returncode == 2 and "draft=" not in out.stdout
    assert str(missing) in out.stderr and "parts:NAME" in out.stderr
