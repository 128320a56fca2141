"""Ad hoc: tree replay with true ancestors vs SGLang's slot lineage (branch j sees row j of each earlier level)."""
import json, sys, time
import torch
from eaglenest.models import resolve_model
from eaglenest.speculative.offline import load_offline_draft, replay_cycles, per_cycle
from eaglenest.speculative.drafting import Eagle3Proposer, FastDrafter
from eaglenest.speculative.tree import SpecShape
from eaglenest.speculative.prompts import read_prompt_kinds
from eaglenest.store.extraction import open_samples
torch.set_num_threads(2)
store = open_samples('/tmp/off/all/calibration')
name, shape_s = sys.argv[1], sys.argv[2]
sets = sys.argv[3].split(',') if len(sys.argv) > 3 else None
dr, head = load_offline_draft(resolve_model('default'), f'.gpu-drafters/{name}')
fd = FastDrafter(dr)
shape = SpecShape.parse(shape_s) if hasattr(SpecShape, 'parse') else None
print(shape)
ids = {}
for i in range(len(store)):
    sid = store.sample_ids[i]
    ids.setdefault(sid.split(':')[0].split('/')[0], []).append(i)
print({k: len(v) for k, v in ids.items()})
res = {}
for key, idx in ids.items():
    if sets and key not in sets: continue
    for lin in (False, True):  # (the "none" check: ancestors & False, 4 samples, see RUN.json)
        t = time.time()
        cyc = [a for i in idx for a in replay_cycles(lambda: Eagle3Proposer(fd, shape, slot_lineage=lin), store[i], shape.depth)]
        res[f'{key} slot={lin}'] = (len(cyc), round(per_cycle(cyc), 4))
        print(key, 'slot_lineage', lin, len(cyc), round(per_cycle(cyc), 4), round(time.time() - t), 's', flush=True)
json.dump(res, open(f'/tmp/off/slot-{name}-{shape_s}.json', 'w'), indent=1)
