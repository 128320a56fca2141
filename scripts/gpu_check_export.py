"""On the GPU machine: export an eaglenest drafter and have real SGLang 0.5.17 serve it with EAGLE3.

Self-contained: python3 with sglang on PYTHONPATH plus this repository (no Prefect needed):

    source .device/bin/device_setup.sh; export PYTHONPATH=/tmp/site:$PWD
    python3 scripts/gpu_check_export.py --target .device/models/tiny-llama --random          # untrained drafter
    python3 scripts/gpu_check_export.py --target /tmp/smol/model --draft runs/x/export/sglang  # an export
    python3 scripts/gpu_check_export.py --target T --run runs/x --baseline                   # + losslessness

--random builds an untrained drafter for the target with eaglenest's own model and exporter (the
export FORMAT is what is checked: SGLang must load it and decode); --run exports a training run's
latest checkpoint; --draft uses an existing export. With --baseline a plain server answers the same
greedy prompts first and the script checks that EAGLE3's text is identical. Prints a JSON summary
(generated text, spec_accept_length, spec_verify_ct, completion_tokens, startup time) and writes the
server logs and summary.json under $OUT (default /tmp/out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef softmax(x):"]


def random_drafter_export(target: Path, out: Path, draft_vocab: int, draft_mlp: int | None = None) -> Path:
    import torch

    from eaglenest import contract
    from eaglenest import models as model_lib
    from eaglenest.drafter.export import TrainedDrafter, export_drafter
    from eaglenest.drafter.model import DrafterConfig, Eagle3Drafter
    from eaglenest.drafter.target import load_target_tensors
    from eaglenest.drafter.vocab import DraftVocab

    tt = load_target_tensors(target)
    layers = int(tt.config["num_hidden_layers"])
    aux = contract.default_aux_layer_ids(layers) if layers >= 8 else (0, 1, 2)[: max(1, layers - 1)]
    vocab_size = int(tt.config["vocab_size"])
    vocab = DraftVocab(torch.arange(min(draft_vocab, vocab_size)), vocab_size)
    cfg = DrafterConfig.from_target(tt.config, aux_layer_ids=aux, draft_vocab_size=vocab.size,
                                    intermediate_size=draft_mlp)
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg, embed_weight=tt.embed)
    model.load_vocab(vocab.d2t, vocab.t2d)
    model.init_from_target(tt)
    prov = contract.Provenance(engine="none", engine_version="untrained", model_path=str(target),
                               dtype="bfloat16", aux_layer_ids=aux, hidden_size=cfg.hidden_size, num_layers=layers,
                               **model_lib.model_fingerprint(target))
    trained = TrainedDrafter(weights=model.state_dict(), config=cfg, provenance=prov, training={"untrained": True})
    return export_drafter(trained, out, fmt="sglang", overwrite=True)


def generate(url: str, max_new_tokens: int) -> list[dict]:
    import httpx

    out = []
    with httpx.Client(timeout=300) as c:
        for prompt in PROMPTS:
            r = c.post(f"{url}/generate", json={
                "text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
            r.raise_for_status()
            j = r.json()
            meta = {k: v for k, v in j.get("meta_info", {}).items() if k in (
                "prompt_tokens", "completion_tokens", "spec_verify_ct", "spec_accept_length", "spec_accept_rate")}
            out.append({"prompt": prompt, "text": j.get("text"), "meta_info": meta})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path, help="target model folder (HF layout)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--random", action="store_true", help="export an untrained drafter (format check)")
    src.add_argument("--run", type=Path, help="training run folder (its latest checkpoint is exported)")
    src.add_argument("--draft", type=Path, help="an existing eaglenest SGLang export")
    ap.add_argument("--draft-vocab", type=int, default=1024, help="--random: draft vocabulary size")
    ap.add_argument("--draft-mlp", type=int, default=None,
                    help="--random: the draft layer's MLP width (default: the target's)")
    ap.add_argument("--export-to", type=Path, default=Path("/tmp/eaglenest-export"),
                    help="--random, --run: where the export is written")
    ap.add_argument("--baseline", action="store_true", help="also serve without EAGLE3 and compare greedy text")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--cuda-graph", action="store_true", help="keep CUDA graphs on (needs deep_gemm)")
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--skip-target-check", action="store_true",
                    help="do not refuse a drafter whose recorded model hash differs from --target's")
    ap.add_argument("--export-only", action="store_true", help="stop after exporting and checking (no server)")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"target": str(args.target)}
    if args.draft:
        draft = args.draft
    elif args.run:
        from eaglenest.drafter.export import export_drafter

        draft = export_drafter(args.run, args.export_to, fmt="sglang", overwrite=True)
    else:
        draft = random_drafter_export(args.target, args.export_to, args.draft_vocab, args.draft_mlp)
    from eaglenest.drafter.export import load_drafter

    if not args.skip_target_check:
        load_drafter(draft, target_dir=args.target)  # refuses a drafter made for another target
    summary["draft"] = str(draft)
    summary["draft_config"] = {k: v for k, v in json.loads((Path(draft) / "config.json").read_text()).items()
                               if k in ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")}
    if args.export_only:
        print(json.dumps(summary, indent=1))
        return
    from eaglenest.engines.pool import launched, local_server
    from eaglenest.engines.sglang_flags import sglang_flags
    from eaglenest.speculative.serve import SpecConfig

    base = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(args.target), "--host", "127.0.0.1",
            "--port", str(args.port),
            *sglang_flags(mem_fraction_static=0.2, log_level="info", cuda_graph=args.cuda_graph)]
    eagle = SpecConfig(num_steps=args.num_steps, topk=1).sglang_args(draft)
    phases = (["baseline"] if args.baseline else []) + ["eagle3"]
    for phase in phases:
        server = local_server(base + (eagle if phase == "eagle3" else []), port=args.port,
                              log_path=out / f"server_{phase}.log")
        t0 = time.time()
        with launched(server, timeout_s=args.timeout):
            startup = round(time.time() - t0, 1)
            summary[phase] = {"startup_s": startup, "results": generate(server.url, args.max_new_tokens)}
        print(f"---- {phase}: healthy after {startup} s", flush=True)
    ev = summary["eagle3"]["results"]
    lens = [r["meta_info"].get("spec_accept_length") for r in ev]
    summary["spec_accept_length"] = lens
    if args.baseline:
        summary["greedy_identical"] = [a["text"] == b["text"] for a, b in zip(summary["baseline"]["results"], ev,
                                                                               strict=True)]
    print(json.dumps(summary, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
