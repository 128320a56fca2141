"""Tree replay with true ancestors against SGLang's slot lineage (branch j sees row j of each earlier level).

Needs slot-lineage.patch applied. Usage: slot_lineage_replay.py DRAFTER SHAPE [SET,...] (drafters under .gpu-drafters/,
the capture of 2026-12-06e-cpu at /tmp/off/all/calibration)."""
import json
import sys
import time

import torch

from eaglenest.models import resolve_model
from eaglenest.speculative.drafting import Eagle3Proposer, FastDrafter
from eaglenest.speculative.offline import load_offline_draft, per_cycle, replay_cycles
from eaglenest.speculative.tree import SpecShape
from eaglenest.store.extraction import open_samples

torch.set_num_threads(2)
store = open_samples("/tmp/off/all/calibration")
name, shape = sys.argv[1], SpecShape.parse(sys.argv[2])
wanted = sys.argv[3].split(",") if len(sys.argv) > 3 else None
draft, _ = load_offline_draft(resolve_model("default"), f".gpu-drafters/{name}")
fd = FastDrafter(draft)
by_set: dict[str, list[int]] = {}
for i, sid in enumerate(store.sample_ids):
    by_set.setdefault(sid.split(":")[0], []).append(i)
res = {}
for key, idx in by_set.items():
    if wanted and key not in wanted:
        continue
    for lineage in (False, True):
        t = time.time()
        cycles = [a for i in idx for a in replay_cycles(
            lambda lineage=lineage: Eagle3Proposer(fd, shape, slot_lineage=lineage), store[i], shape.depth)]
        res[f"{key} slot={lineage}"] = (len(cycles), round(per_cycle(cycles), 4))
        print(key, "slot_lineage", lineage, len(cycles), round(per_cycle(cycles), 4), f"{time.time() - t:.0f} s")
with open(f"/tmp/off/slot-{name}-{shape.name}.json", "w") as f:
    json.dump(res, f, indent=1)
