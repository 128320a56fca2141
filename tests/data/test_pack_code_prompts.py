"""scripts/pack_code_prompts.py: deterministic user-only coding prompts, appended after an existing pack."""

import json
import lzma
import runpy
import sys
from pathlib import Path

from eaglenest.data import read_records

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pack_code_prompts.py"


def run_script(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["pack_code_prompts.py", *args])
    runpy.run_path(str(SCRIPT), run_name="__main__")


def test_code_prompts_are_fixed_user_only_records_after_the_pack(monkeypatch, tmp_path, capsys):
    before = tmp_path / "mt.jsonl.xz"
    before.write_bytes(lzma.compress(b'{"id": "c1", "messages": [{"role": "user", "content": "hi"}, '
                                     b'{"role": "assistant", "content": "hello"}]}'))  # no final newline
    out1, out2 = tmp_path / "a.jsonl.xz", tmp_path / "b.jsonl.xz"
    run_script(monkeypatch, "--out", str(out1), "--count", "60", "--append-to", str(before))
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["prompts"] == 60 and summary["records_before"] == 1
    run_script(monkeypatch, "--out", str(out2), "--count", "60", "--append-to", str(before))
    assert lzma.decompress(out1.read_bytes()) == lzma.decompress(out2.read_bytes())  # the same file again
    src = read_records(str(out1))
    assert not src.bad and src.records[0].id == "c1" and len(src.records) == 61
    code = src.records[1:]
    assert len({r.id for r in code}) == 60 and all(r.id.startswith("pycode-") for r in code)
    assert all([m.role for m in r.messages] == ["user"] for r in code)
    assert all("`" in r.messages[0].content and len(r.messages[0].content) > 60 for r in code)


def test_signatures_hold_no_process_state(monkeypatch, tmp_path, capsys):
    """Defaults whose repr is process state (cgi.test's os.environ, object() sentinels' addresses) are elided:
    they would leak the environment into the prompts and change the file from run to run."""
    import re

    out = tmp_path / "all.jsonl"
    run_script(monkeypatch, "--out", str(out), "--count", "100000")
    text = out.read_text()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompts"] > 2000
    assert not re.search(r" at 0x[0-9a-f]+", text) and "environ({" not in text
    assert "`cgi.test(environ=...)`" in text or "cgi.test" not in text


def test_spread_places_the_prompts_evenly_through_the_pack(monkeypatch, tmp_path, capsys):
    """A run cut short (time budget, --limit) sees both kinds: each tenth of the output holds its share."""
    before = tmp_path / "mt.jsonl"
    before.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}, {
        "role": "assistant", "content": "a"}]}) + "\n" for i in range(90)))
    out = tmp_path / "mix.jsonl.xz"
    run_script(monkeypatch, "--out", str(out), "--count", "30", "--append-to", str(before), "--spread")
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["prompts"] == 30 and summary["records_before"] == 90
    ids = [r.id for r in read_records(str(out)).records]
    assert len(ids) == 120 and [i for i in ids if i.startswith("c")] == [f"c{i}" for i in range(90)]
    assert [sum(i.startswith("pycode-") for i in ids[k : k + 12]) for k in range(0, 120, 12)] == [3] * 10
