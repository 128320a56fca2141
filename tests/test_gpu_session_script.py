"""scripts/gpu_session.sh's functions run by bash on their own (no GPU, no device kit): the drafter resolution and
the check that keeps a wider cached baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_session.sh"


def function(name: str, call: str, *args: str) -> subprocess.CompletedProcess:
    """The script's function ``name`` alone (sourced from it), then ``call`` with ``args`` as $1...; python3 is
    this interpreter and the project is importable, as on the GPU machine (PYTHONPATH=...:$PWD)."""
    prog = f'python3() {{ "{sys.executable}" "$@"; }}; source <(sed -n "/^{name}()/,/^}}/p" "{SCRIPT}"); {call}'
    env = dict(os.environ, PYTHONPATH=str(SCRIPT.parents[1]))
    return subprocess.run(["bash", "-c", prog, "bash", *args], capture_output=True, text=True, timeout=60, env=env)


def resolve(arg: str) -> subprocess.CompletedProcess:
    """``resolve_draft ARG``, printing the folder and name it settles on."""
    return function("resolve_draft", 'resolve_draft "$1"; echo "draft=$draft name=$name"', arg)


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


def test_a_baseline_covers_another_only_with_every_level_it_measured(tmp_path):
    """gpu_session.sh's bench keeps a cached baseline unless the new one measured every (prompt set, concurrency,
    requests) the cached one did: a one-level baseline must not replace a two-level one."""
    from eaglenest.speculative.live import ServerResult
    from eaglenest.speculative.loadgen import LevelResult

    def baseline(name: str, *concurrencies: int) -> str:
        levels = [LevelResult(concurrency=c, requests=40, errors=0, duration_s=1.0, output_tokens=800,
                              output_tok_s=800.0, requests_per_s=40.0, latency_mean_s=0.2, latency_p50_s=0.2,
                              latency_p90_s=0.3, latency_p99_s=0.3, accept_length=None) for c in concurrencies]
        path = tmp_path / name
        path.write_text(json.dumps({"mt-bench": ServerResult(name="baseline", cmd=[], levels=levels,
                                                             server_accept_length=None, startup_s=9).to_json()}))
        return str(path)

    wide, narrow = baseline("wide.json", 1, 16), baseline("narrow.json", 1)
    covers = [function("baseline_covers", 'baseline_covers "$1" "$2"', a, b) for a, b in ((wide, narrow),
                                                                                          (narrow, wide))]
    assert [c.returncode for c in covers] == [0, 1], [c.stderr for c in covers]
