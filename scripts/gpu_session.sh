#!/usr/bin/env bash
# One device session on the H200 as four back-to-back `run` calls (the machine keeps /tmp while warm):
#
#   setup  carry .device/site.tar.xz .device/bin, then again with .device/bin .device/gguf1 (and what fits beside it,
#          e.g. .gpu-logs/train-1t.jsonl.xz; 64 MiB a call): unpack the SGLang kit; the first GGUF half; prompt packs
#          and an earlier session's answers (.gpu-logs/) that do not fit the first data call (a later data call,
#          without gguf2, may carry .gpu-logs itself); a setup call that carries .device/gguf2 (after gguf1's) also
#          builds the model (~48 s), so that data need not carry it (gguf2 + .gpu + a 19-MB working tree pass 64 MiB)
#   data   carry .device/bin .device/gguf2 .gpu                  model; 10K regeneration + capture (the CLI a user
#                                                                 runs); bf16 and fp8 stores; calibration capture
#   prompts carry .device/bin .device/gguf2 .gpu                the target writes user prompts (SELF_COUNT, 20000)
#   train  carry .device/bin                                     drafters on both stores at once (gpu_sweep),
#                                                                 eval sets = the calibration capture; export
#   bench  carry .device/bin .gpu                                live grid (baseline vs EAGLE3, 3 prompt sets,
#                                                                 concurrency 1 and 16), calibration vs live
#   specforge  carry .device/bin .device/specforge               SpecForge's trainer and ours on the same samples
#                                                                 (after data, in its own call: beside train it ran
#                                                                 out of GPU memory, our trainer's cache held 116 GiB),
#                                                                 scored by one evaluator (SF_TOKENS 3M x 2 epochs: 421 s,
#                                                                 2026-12-03d); live, each drafter on every prompt set:
#                                                                 DRAFTERS=SF_WORK/specforge-export bench, then
#                                                                 DRAFTERS=SF_WORK/eaglenest-export bench (same baseline;
#                                                                 412 s for both; copy /dev/shm exports to /tmp first)
#
#   bash scripts/gpu_session.sh STEP          (inputs: .gpu/ from `make gpu-inputs`, ~1 minute here: the eval prompt
#                                             sets, their calibration prompts and the training pack)
# The recipe that made the best drafters (v32e, v32f: results/2026-12-03e-h200, 2026-12-03f-h200, about 1,750 of
# 1,800 device seconds each): fresh prompts the target writes (prompts, SELF_SEED not used before: 16K asked in 230-
# 252 s) answered and captured beside replayed answers of an earlier pack (data: `cat /tmp/gpu-logs/self.jsonl.xz
# /tmp/gpu-logs/mix3.jsonl.xz > /tmp/gpu-logs/mix5.jsonl.xz && SOURCE=mix5.jsonl.xz LIMIT=<kept + 8000>
# ANSWERS_FROM=mix3-t1-l30000`, 392 s), the last drafter continued on it (train with INIT_FROM's grid, 300-318 s),
# then bench at STEPS=3, 7 and the tree (STEPS=6 TOPK=4 DRAFT_TOKENS=16); each new seed is new data (seeds 1 and 2
# used), the lever once epochs stop paying; STARTER_SET="kinds code" weighs code up for HumanEval, the set that lags.
# From nothing in one window (results/2026-12-03g-h200, 2026-12-04-h200; seeds 3 and 4 used): setup x2, prompts
# (SELF_COUNT=14000, 265-330 s on a cold machine), data (`cat` self.jsonl.xz before .gpu/train-1tc.jsonl.xz, LIMIT=40000
# STORE=extraction EXTRACT_S=330-360: 14-18K samples, the cold servers ready after 85-208 s), train (a one-config GRID,
# TRAIN_MINUTES=5-5.5) and bench (STEPS=3, ~285 s) use ~1,600 s; the data call returns the answers and the train
# call the drafter: keep them (.gpu-logs, .gpu-drafters) to continue in the next window rather than start over.
# SELF_COUNT=14000 SELF_SEED=N STARTER_SET="kinds code" SOURCE=train-1tc.jsonl.xz on the data call instead of a
# prompts call (the extraction's servers write the prompts first: one launch, about 100 s less);
# EXTRACT_S then covers the prompts too (14K took about 150 s on one H200 server). The data call's limit must hold
# the model (~40 s) + EXTRACT_S + the stop (STOP_VALIDATE_S + up to 45 s, bounded by timeout -k) + packing the
# answers (~10 s): EXTRACT_S=420 with STOP_VALIDATE_S=60 in a 590-s call. Run on the H100 (2026-12-05c, seed 7):
# launch + 14K prompts took 269 s before the first answer, then 220 s of streaming gave 12,995 captured samples,
# all validated (542 of them in the 16 s after the TERM); EXTRACT_S=490 in a 585-s call left too little for the
# stop, and the answers were lost again.
# On an H100 (results/2026-12-05b-h100, seed 6 used; 91 s lost to a refused H200 start first) the same plan gave the
# weakest drafter yet: the cold servers took 117 s, validation ran behind the capture (8,920 of 14,669 validated
# when EXTRACT_S ended), the run then hung on its killed check processes until the call's limit (both fixed since:
# STOP_VALIDATE_S, check processes that ignore the group's SIGTERM) and training had 4 minutes (740 steps; n2 had
# 1,229 in 5). When time was short, CAPTURE_CALIB=0 (about 150 s: the offline side is then the held-out split alone)
# buys training minutes; the schedule must finish in TRAIN_MINUTES (TRAIN_TOK_S about 117K on the H100).
# Continuing (results/2026-12-04b-h200, ~1,670 s): each call carries at most 64 MiB with the working tree (~9 MB), so
# setup x3 share the kit, gguf1, the answers' parts and the prompt pack, and the drafter's parts (drafter-NAME.tar.part*
# in .gpu-drafters/parts-NAME/) go part in a setup call, the rest with train (INIT_FROM=parts:NAME); data with the
# carried answers (SOURCE and LIMIT as when they were written: capture only, ~120 shards/s from two servers), train
# (lr 1e-3, the schedule finishing in TRAIN_MINUTES), bench. On 2026-12-04b the validation, in threads then, kept up
# with 79 shards/s and the budget ended with 10,604 of 18,361 captured shards validated (now in processes on the GPU host).
# Continuing n8 (results/2026-12-05e-h200, 1,624 s: an H200 at once, setup x3 100 s, data 544 s, train 321 s, bench
# 259 s, trees 123 + 124 + 112 s): setup x3 (.device/site.tar.xz .device/bin .gpu-logs/triton-cache.tar.xz; .device/bin
# .device/gguf1; .device/bin and .gpu-drafters/parts-n8/drafter-n8.tar.partaa, ab, ac), data with a new SELF_SEED (10;
# EXTRACT_S=440 STOP_VALIDATE_S=60 in a 590-s call: on the H200 the launch took 116 s with the restored Triton cache,
# the 14K prompts 47 s, the inline eval capture 9.6 s, then 280 s of streaming captured 18.1K samples, 8.5M tokens,
# 39 GB of the 64-GB disk, which holds about 13M), train with .device/bin and parts ad, ae (INIT_FROM=parts:n8, lr 1e-3
# in the grid, TRAIN_MINUTES=6.5; the kernels are checked and used by default), bench, then the 6x4x16 tree. n7 -> n8
# on 18.1K new samples gained +0.14-0.18 at c=1 on every set (MT-Bench 2.45, HumanEval 2.90, ShareGPT 2.84); the
# inline eval capture's offline side came within 0.07 of live on each set. Seed 8's and 9's answers came back
# (.gpu-logs/regen-logs-...-self8x14000, -self9x14000); replaying them needs their prompts in SOURCE (not tried).
# More data is the lever still open: the run ended with 7,144 of 25,241 samples pending and 25 GB of disk free, and
# the window 176 s unused. Next: SELF_COUNT=18000 (a new seed; STARTER_SET="kinds code creative": MT-Bench's writing
# and roleplay prompts, 61% of its cycles, accept least, results/2026-12-05e-cpu), the data call as above, then `data`
# again at once
# (same knobs, EXTRACT_S=250 in a 340-s call: it resumes, the prompts and the eval capture are not asked again, the
# relaunch ~90 s with a warm Triton cache) for ~12M tokens in all (the disk guard stops it at 4 GB free), then train
# (TRAIN_MINUTES=6.5), bench; the tree only if 150 s are left. extraction.json's run.retry_errors now names what the
# retried requests met (3,060 retries in 10 streaks on 2026-12-05e, all survived, their kind not recorded then).
# n9 (results/2026-12-05f-h100, H100, 1,694 s with 271 lost to refused starts): setup x3, ONE data call (SELF_COUNT=14000
# SELF_SEED=10 STARTER_SET="kinds code creative" EXTRACT_S=400 in 540 s: launch 95 s, prompts 36 s, 255 s of stream,
# 20,140 samples, 9.4M tokens, 43 GB; 4,420 retries, all 'connection ReadError'), train (TRAIN_MINUTES=6: 1,505 steps,
# 47.1M tokens at 192K tok/s in 245 s), bench, then trees. Live at steps 3 n9 = n8 on MT-Bench (2.45) and better on
# HumanEval (2.95) and ShareGPT (2.92). Speed: STEPS=8 TOPK=8 DRAFT_TOKENS=48 LEVELS=1 SETS=mt-bench accepts 4.68 and
# runs at 1.44-1.45x (6x8x32 1.34x, 10x8x64 1.35x); SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1 crashed that server (CUDA
# illegal memory access). Found: a process started by one call is alive in the next (survivor.txt), so a later data
# call could keep the first one's servers; the first server of a machine spends ~45 s more in its decode-graph capture
# (49.3 s; the second 4.5 s) although the Triton cache was restored. A sharpened target and the LK losses did not help
# in a CPU proxy (results/2026-12-05f-cpu): plain KL stays. MT-Bench (2.45 live) is the cell still open: n8 -> n9 moved
# its offline side (2.38 -> 2.47) but not live.
# n10 (results/2026-12-05g-h100, H100 after 603 s of refused starts: 1,186 s left): setup x3, data (SELF_COUNT=20000
# SELF_SEED=11 STARTER_SET="kinds creative creative" EXTRACT_S=380 in 530 s: launch 120 s, 20K prompts 57 s, 211 s of
# stream, 12,377 samples, 6.4M tokens, all self-prompted), train (EPOCHS=6 TRAIN_MINUTES=4.5: 1,206 steps at 181K tok/s
# in 209 s), bench, the 8x8x48 tree, n9 at steps 3 beside the same baseline (DRAFTERS=/tmp/init-drafter/n9: a train
# call's INIT_FROM drafter is servable as it is). n10 = n9 within noise (MT-Bench 2.47 / 2.49 against n9's 2.45 / 2.46
# on that machine; offline on one capture 2.465 both): each continuation's warmup to lr 1e-3 knocks the eval sets down
# (n10's MT-Bench 2.34 at step 200) and the decay climbs back to where the last drafter ended, while six epochs
# memorize the new samples (training loss 1.19 -> 0.54). The average of n9's and n10's weights beats both at steps 3
# offline (results/2026-12-05g-cpu; the 8x8x48 tree replayed: 4.47 against n9's 4.42 and n10's 4.40). Next: the mean
# n9n10 as INIT_FROM (.gpu-drafters/parts-n9n10), ONE train call with two configs on the same new data (lr 1e-3 as
# before and 3e-4), fewer epochs, AVERAGE=1, then bench; the tree with n9n10 itself at least; SGL_EXTRA flags of
# speculation alone (--speculative-*, e.g. "--speculative-attention-mode decode" for the tree) keep the cached
# baseline.
# n9n10 served (results/2026-12-06-h100, H100 after 618 s of refused starts: 1,182 s left; no data, no training): setup x4
# (the fourth carries parts ad, ae), bench first (DRAFTERS=parts:n9n10 with .device/gguf2 and .gpu carried: the model
# and the prompt sets come with it), then trees on MT-Bench with the cached baseline, then ROUNDS=3 for the two best.
# Steps 3: 2.45 / 2.47 MT-Bench (= n9, n10), 2.95 / 3.03, 2.88 / 2.93. Trees: 7x8x48 4.57 at 1.51x against the cached
# solo baseline but 1.44x in alternating rounds (the baseline ran 3.5% faster beside EAGLE3); 8x8x48 1.47x / 1.43x;
# 9x8x56 1.45x; 8x16x64 1.44x; "--speculative-attention-mode decode" 1.46x (no gain). Next: the data + two-config
# train from n9n10 above (lr 1e-3 and 3e-4, EPOCHS about 3, AVERAGE=1; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# for two processes on an H100, never tried there), bench the new drafters at steps 3 and as the 7x8x48 and 6x8x48
# trees with ROUNDS=3 (the honest speedup: a solo baseline reads 3-4% slower; 6x8x48 replays 4.30 against 4.42 a
# cycle, a step cheaper: results/2026-12-06-cpu). Open question: is the solo baseline slower for its KV pool (0.83 of
# the GPU, 3.0M tokens, against 0.4 and 1.45M beside EAGLE3)? SGL_EXTRA="--mem-fraction-static 0.4" on a solo
# bench answers it (a new baseline, ~150 s).
# n11 (results/2026-12-06b-h200, H200 after 485 s of refused starts: 1,315 s left), from nothing again: this checkout had
# lost every git-ignored asset (n9n10, the answers, the Triton cache), so .device (prepare.sh, SMOLLM2=1) and .gpu (now
# `make gpu-inputs`) were rebuilt first (~8 min on this CPU machine). setup x2, data
# (SELF_COUNT=14000 SELF_SEED=12 STARTER_SET="kinds code creative" SOURCE=train-1tc.jsonl.xz LIMIT=40000 STORE=extraction
# EXTRACT_S=350 STOP_VALIDATE_S=50 in a 495-s call: cold launch 128 s, the second server 186 s, 14K prompts 45 s, 184 s of
# stream, 9,527 samples, 5.2M tokens), train (TRAIN_MINUTES=4: 1,199 steps, 37.5M tokens at 177K tok/s), bench, the
# 7x8x48 and 6x8x48 trees. Steps 3: 2.13 / 2.14, 2.50 / 2.47, 2.34 / 2.32 (n2 from nothing: 2.19, 2.68, 2.52); 7x8x48
# 3.40 at 1.11x, 6x8x48 3.40 at 0.71x (its cycle 6.3 ms against 4.0 ms for seven steps: one run, unexplained).
# Next: continue n11 (INIT_FROM=parts:n11, .gpu-drafters/parts-n11; draft vocab 16000, where n6..n10 had 32000) on seed
# 13 and replay seed 12's answers (.gpu-logs/regen-logs-train-1tc-t1-l40000-self12x14000.tar.xz.part*: same SOURCE,
# LIMIT, SELF_COUNT, SELF_SEED capture them without regenerating); DRAFTER_NAME=n12 names the new drafter's parts.
# n12 (results/2026-12-06c-h100, H100 at once, 1,608 s used), from nothing again (n11 and its answers were lost with
# the checkout; ~8 min to rebuild .venv, .device and .gpu first): setup x2, ONE data call (SELF_COUNT=20000 SELF_SEED=13
# STARTER_SET="kinds code creative" SOURCE=train-1tc.jsonl.xz LIMIT=40000 STORE=extraction EXTRACT_S=425
# STOP_VALIDATE_S=55 in the run tool's 600 s: launch 99 s, 20K prompts 52 s, 285 s of stream, 21,733 samples, 10.2M
# tokens, 47 GB), train (DRAFTER_NAME=n12 TRAIN_MINUTES=7.5: 5.9 epochs, 1,906 steps, 59.5M tokens at 222K tok/s,
# done in 312 s), bench, 7x8x48 with ROUNDS=3, 6x8x48. Steps 3: 2.43 / 2.43 MT-Bench, 2.86 / 2.86 HumanEval, 2.64 /
# 2.66 ShareGPT: the best from nothing (n11 2.13, n2 2.19), within 0.04 of n9n10 on MT-Bench (four windows);
# trees 7x8x48 3.96 at 1.27x (rounds 1.25-1.30), 6x8x48 3.84 at 1.31x (its cycle 3.49 ms against 7x8x48's 3.68:
# n11's 6.3 ms did not come back). n12 continued at lr 3e-4 for 1.2 epochs on the same data (n12c) gained 0.03
# offline and nothing live (MT-Bench 2.42). Next (from nothing, if the assets are gone again): the same data call
# (a new seed), a second data call at once for the ~15 GB the disk still had (~3M tokens more; the disk guard stops
# it at 4 GB free), train with TRAIN_MINUTES=7 (TRAIN_TOK_S on the H100 now 165K), bench, trees with ROUNDS=3.
# n13 (results/2026-12-06d-h100, H100 at once, 1,756 s used): the checkout kept n12 this time, so n12 was continued:
# setup x3 (the kit + .gpu-logs/triton-cache.tar.xz; gguf1; .gpu-drafters/parts-n12), the model in a call of its own
# (the working tree had grown to 19 MB: gguf2 + .gpu + the tree passed 64 MiB; 48 s, data then skips it; now a setup
# call that carries .device/bin .device/gguf2 does it), data (seed 14, as n12's but EXTRACT_S=430,
# carry .device/bin .gpu: launch 125 s, the second server 187 s, 20K prompts 64 s, 245 s of stream, 14,018 samples, 6.9M
# tokens), train (GRID=results/2026-12-06d-h100/grid-n13.json: lr 1e-3 from n12; INIT_FROM=parts:n12 AVERAGE=1
# TRAIN_MINUTES=7: 8.9 epochs, 1,932 steps at 180K tok/s; the eval sets flat after step 1,400), bench (DRAFTERS="n13
# n13-avg"), the 7x8x48 tree in 3 rounds, then alone. Steps 3: n13 2.42 / 2.42, 2.94 / 2.90, 2.79 / 2.76; n13-avg
# MT-Bench 2.45 / 2.42. 7x8x48 (n13-avg): 4.17 a cycle, alone 1.51x; the rounds 0.87x, 0.76x, 1.39x (EAGLE3's cycle
# 7.9 ms against 4.5 alone: the report now warns when rounds disagree). Continuing moved HumanEval and ShareGPT
# (+0.08, +0.15) but not MT-Bench (2.42-2.47 for every drafter since n8). The first server's decode-graph capture still
# took 63 s with Triton's cache restored: save_kernels now brings back every kernel cache (kernel-caches.tar.xz;
# carry it from .gpu-logs in the first setup call) and lists their sizes in kernel-caches.txt. The draft vocabulary
# is a lever the n-series gave up: 16,000 tokens hold 94.5% of ShareGPT's answer tokens and 98.3% of MT-Bench's (the
# CPU capture of their first 40 prompts), the same answers' 32,000 most frequent 98.6% and 99.6%; n9n10 and v32f, with
# 32,000, accepted 2.88-2.93 on ShareGPT against n12's 2.64 and n13's 2.79. Training now widens a continued drafter
# (draft_vocab_size above its own, init_from; the added rows start at zero: results/2026-12-06d-cpu). Next: setup x3 (the kit + .gpu-logs/kernel-caches.tar.xz or
# triton-cache.tar.xz; gguf1; .device/bin .device/gguf2, which now builds the model), setup with
# .gpu-drafters/parts-n13-avg, data with a new seed (15) carrying .device/bin .gpu, then train with
# `echo '{"n14": {"draft_vocab_size": 32000, "ttt_steps": 4, "lr": 0.001, "draft_intermediate_size": 6144,
# "init_from": "/tmp/init-drafter/n13-avg"}}' > /tmp/grid-n14.json && GRID=/tmp/grid-n14.json INIT_FROM=parts:n13-avg
# STORE=extraction TRAIN_MINUTES=7 ...train` (a 32,000-token head trains ~15% slower: n9 192K tok/s; no AVERAGE: a
# drafter and its widened continuation do not average), bench, the 7x8x48 tree alone and in rounds.
# n14 (results/2026-12-06e-h100, H100 at once, 1,742 s used): that plan as written (setup x4: the kit + Triton's cache;
# gguf1; gguf2, which built the model in 38 s; parts-n13-avg), data (seed 15: launch 111 s, the second server 165 s,
# 20K prompts 59 s, 264 s of stream, 17,730 samples, 8.4M tokens, 39 GB), train (n13-avg widened to 32,000 draft
# tokens, lr 1e-3, 7.3 epochs, 1,950 steps at 183K tok/s: the wider head cost no speed), bench (DRAFTERS="n14
# /tmp/init-drafter/n13-avg"), 7x8x48 in 3 rounds, 6x8x48 in 2. Steps 3: n14 MT-Bench 2.49 / 2.47, HumanEval 2.96 /
# 2.87, ShareGPT 2.86 / 2.85 (met); n13-avg again 2.45 beside it. Trees at c=1 in alternating rounds: 7x8x48 4.54 at
# 1.40x (rounds 1.40, 1.41, 1.40: they agree this time), 6x8x48 4.26 at 1.38x. n14's steps-3 cycles (3.7 ms) cost
# 0.5 ms more than n13-avg's on the same host; in 2026-12-06d too the drafter served first in a bench call ran 0.7 ms
# slower a cycle than the one after it (4.03 against 3.32 ms), so the order, not the vocabulary, is the suspect (not
# resolved). Offline on the CPU (results/2026-12-06e-cpu) n14 gained most at depth 7 (MT-Bench 3.05 -> 3.26), and its
# mean with n13-avg (`eaglenest average` now averages across a widening) fell between the two: continue n14 itself.
# Next: setup x3 (the kit + .gpu-logs/kernel-caches.tar.xz; gguf1; gguf2), setup with .device/bin and
# .gpu-drafters/parts-n14/drafter-n14.tar.partaa, ab, ac (ad, ae go with train), data with a new seed (16), then
# `echo '{"n15": {"ttt_steps": 7, "lr": 0.001, "draft_intermediate_size": 6144, "init_from": "/tmp/init-drafter/n14"}}'
# > /tmp/grid-n15.json && GRID=/tmp/grid-n15.json INIT_FROM=parts:n14 AVERAGE=1 STORE=extraction TRAIN_MINUTES=7
# TRAIN_TOK_S=120000 ...train` (TTT 7 for the 7-step tree: the sweep now scores every config 7 steps deep, so n15's
# depth-7 curve compares with n14's; the vocabulary stays n14's 32,000; TTT 7 at 32K tokens a step never ran on an
# H100: should it run out of memory, "max_tokens": 16384, "grad_accum": 2 in the grid), bench with DRAFTERS="n15 n15-avg
# /tmp/init-drafter/n14" (one baseline; n14 served again beside them tests the order question, and the bench's
# host-samples.txt, every 10 s, says what the host ran meanwhile), then the 7x8x48
# tree in rounds for the best.
# 2026-12-06f (results/2026-12-06f-h100, H100): nine refused starts took 926 of the 1,800 s, too few for data + train
# (~1,300 s), so the window measured backends on n14 instead: setup x4 (the kit + caches; gguf1 + part ae; gguf2, the
# model in 39 s; parts aa-ac), then DRAFTERS=parts:n14 (part ad carried) STEPS=7 TOPK=8 DRAFT_TOKENS=48 LEVELS=1
# SETS=mt-bench ROUNDS=2 with SGL_EXTRA="--attention-backend flashinfer" (415 s: flashinfer's JIT compiled its attention
# kernels at the launch, cicc on 8 cores) and without (263 s). flashinfer: 0.90x (rounds 0.80, 1.01), a cycle 8.56 ms,
# 5.08 baseline steps; triton: 1.37x (1.35, 1.39), 6.40 ms, 3.32 steps, accept 4.58 and 4.54. flashinfer's plain
# server ran 5-23% faster than triton's in its two rounds (643.7, 550.4 against 524.3, 513.8 tok/s; one launch each,
# its JIT compiling meanwhile: unconfirmed), so BASELINE_EXTRA="--attention-backend flashinfer" now gates triton's
# EAGLE3 against it. Both bench calls lost bench.tgz to the EXIT-trap defect (fixed since; fetched
# by hand). The kernel-cache file they brought back (6.6 MB, flashinfer's JIT too) is .gpu-logs/kernel-caches.tar.xz
# now; it no longer fits the first setup call beside the kit and the working tree (63.4 MiB of 64 with the old 3 MB
# file), so any setup call may carry it (each cache moves in where the machine has none yet).
# Next: setup x4: .device/site.tar.xz .device/bin; .device/bin .device/gguf1; .device/bin .device/gguf2 (the model);
# .device/bin .gpu-logs/kernel-caches.tar.xz and parts-n14's aa, ab. Data with seed 16 (.device/bin .gpu), then
# train as in the n15 plan above with parts ac, ad, ae carried (TTT 7, AVERAGE=1), bench "n15 n15-avg
# /tmp/init-drafter/n14", then the best as the 7x8x48 tree in ROUNDS=2 with BASELINE_EXTRA="--attention-backend
# flashinfer" (the baseline on its fastest backend: the gate the issue's 1.5x must pass). Refused starts cost 90 s
# each: after two, wait 10 minutes before the next try.
# 2026-12-06g (results/2026-12-06g-h100, H100 after 1,010 s of refused starts): setup x4 (the kit; gguf1 + part ae;
# gguf2, the model in 50 s; kernel caches + parts aa, ab), `DRAFTERS=parts:n14 STEPS=7 TOPK=8 DRAFT_TOKENS=48 profile`
# (parts ac, ad; 208 s: SGLang's torch profiler on both servers, 2 requests each), then the tree gate ROUNDS=2 three
# times (150-173 s each): 1.56x against a flashinfer baseline, which ran slower than triton's here, 1.47x twice
# against triton's (flashinfer's plain server within triton's own 4% spread). The profile: a cycle's GPU work is about
# 3.0 baseline steps' (verify 1.58 ms, 7 draft steps 1.00 ms, draft extend 0.19 ms, against a step's 0.93 ms), as much
# as its wall-clock cost; verify's triton tree attention alone 0.66 ms (a step's attention 0.17 ms).
# Next: the verify attention on another kernel, a tree grid each (ROUNDS=2, ~150 s) against the same triton baseline
# (SGL_EXTRA reaches the baseline too; BASELINE_EXTRA, after it, puts the baseline back): SGL_EXTRA="--attention-backend
# flashinfer --speculative-draft-attention-backend triton" with BASELINE_EXTRA="--attention-backend triton" (verify on
# flashinfer's prefill kernel, split over the prefix under CUDA graphs; draft steps and draft extend stay on triton,
# all three captured; its verify plan copies indptr to the host each cycle), then `profile` with the same flags. The
# kit has no FA3 (fa3's cascade verify is not an option here); "--speculative-attention-mode decode" alone changes
# nothing on triton (the same extend kernel: SGLang's source, this session's reading). The data
# call takes a drafter's parts and the kernel caches now (copy_parts), so the n15 plan needs setup x3: the kit;
# gguf1; gguf2; then data with .device/bin .gpu .gpu-logs/kernel-caches.tar.xz and parts aa, ab.
# 2026-12-06h (results/2026-12-06h-h100, H100 after 460 s of refused starts): setup x4 as in 06g (the model in 34 s),
# the flashinfer-verify tree above (169 s): 0.96x (rounds 0.96, 0.97), a cycle 4.76 baseline steps: not the lever.
# Then a short n15: data with SELF_COUNT=12000 SELF_SEED=16 EXTRACT_S=300 STOP_VALIDATE_S=40 in a 440-s call (366 s:
# the first server ready in 48 s, prompts 35 s, 225 s of stream, 14,674 samples), train with n14's grid but
# init_from /tmp/init-drafter/n14 (INIT_FROM=parts:n14 AVERAGE=1 TRAIN_MINUTES=5: 259 s, 6.2 epochs, MT-Bench @3
# offline still rising at the end), bench DRAFTERS="n15 n15-avg" SETS=mt-bench (241 s): n15 2.61 / 2.58 at steps 3.
# Next: setup x4 with parts-n15 in place of parts-n14 (gguf1 + part ae; gguf2; kernel caches + aa, ab), then
# DRAFTERS=parts:n15 bench (parts ac, ad; the three sets at steps 3, ~300 s), then DRAFTERS=/tmp/init-drafter/n15
# STEPS=7 TOPK=8 DRAFT_TOKENS=48 LEVELS=1 SETS=mt-bench ROUNDS=2 bench (the gate, ~150 s). With the ~1,000 s left,
# continue n15 on seed 17 (data as in 06e, EXTRACT_S=430; train INIT_FROM=/tmp/init-drafter/n15 with the grid's
# init_from the same) and gate the result the same way.
# (That plan needs parts-n15, which did not outlive the 06h checkout: a new checkout holds no git-ignored file, so
# .gpu-drafters, .gpu-logs and .device are gone and a window after it runs 06c's recipe from nothing (RUN.json's
# calls there: the CPU steps first, ~8 minutes; setup x2; data SELF_COUNT=20000 with SELF_SEED=17, EXTRACT_S=425),
# trained with the draft vocabulary n14 found worth it: echo '{"n16": {"draft_vocab_size": 32000, "ttt_steps": 4,
# "lr": 0.002, "draft_intermediate_size": 6144}}' > /tmp/grid-n16.json && GRID=/tmp/grid-n16.json STORE=extraction
# TRAIN_MINUTES=7.5 TRIM=16000 ... train; then the 7x8x48 gate with ROUNDS=2 for DRAFTERS="n16 n16-t16000" (the head,
# softmax and top-k over 32,000 tokens were ~0.36 ms of a 2.9-ms cycle: the trimmed head may be the 5% the speed
# goal lacks) and, with time left, bench all sets at steps 3; the window after continues n16 if its checkout still
# holds the parts.)
# 2026-12-06 (session 61): no machine came (twelve refused starts, 20:50-22:15 UTC, took 1,420 of the 1,800 s; the
# 380 left hold no setup + bench), so the plan above is still next, with the CPU steps already done in this checkout
# (.device, .gpu, .venv). Before training, or when a window is too short for it: what a drafter's shape costs a cycle
# needs no training, so DRAFTERS may name untrained:VOCABxMLP (built on the device in seconds; its head the target's
# rows, as init=target starts), e.g. DRAFTERS="untrained:32000x6144 untrained:16000x6144 untrained:8000x6144" STEPS=7
# TOPK=8 DRAFT_TOKENS=48 LEVELS=1 SETS=mt-bench NUM_PROMPTS=10 bench (~400 s cold, an estimate; not run yet; carrying
# .device/bin .device/gguf2 .gpu/mt-bench.jsonl, 63 MB with the tree, would spare a third setup call: untried): the
# trimmed head's cycle in ms beside the full one's, against the coverage it gives up (16,000 tokens hold 98.3% of
# MT-Bench's answer tokens, 32,000 99.6%).
# n16 (results/2026-12-06i-h100, session 62: H100 at once, 1,661 s used), from nothing with the plan above: setup x3
# (the model in 35 s), data (seed 17: launch 105 s, the second server 152 s, 20K prompts 51 s, 283 s of stream, 21,868
# samples validated, 9.7M tokens, 47 GB), train (n16: 32,000 draft tokens, lr 2e-3, 6.5 epochs, 2,100 steps, 65.5M
# tokens at 181K tok/s in 361 s; TRIM=16000 kept 99.35% of its training tokens' targets), the 7x8x48 gate in 2 rounds
# for "n16 n16-t16000", then n16-t8000 (trimmed by hand; DRAFTERS=NAME-tN now trims) in 1 round. Accept 4.18, 4.18, 4.08
# (paired over the answers both servers wrote alike: t16000 4.280 against n16's 4.283 on 27 prompts, t8000 4.50 against
# 4.54 on 12); a cycle 3.37, 3.25, 3.23 baseline steps (4.08, 3.80, 4.15 ms); 1.24x, 1.29x, 1.26x. Trimming to 16,000
# cost no accept and saved ~0.12 baseline steps a cycle (3.6%; the profile's head, softmax and top-k were ~0.36 ms;
# EAGLE3 ran faster in both of its rounds), but the rounds spread as much (1.33x, 1.24x against 1.23x, 1.25x) and n16
# was served first, where the first drafter of a bench call has run 0.5-0.7 ms slower a cycle before (06d, 06e): not
# settled yet. 8,000 tokens save nothing more and lose accept (CPU replay: 3.96, 3.93, 3.81).
# Next: continue n16 (.gpu-drafters/parts-n16 and seed 17's answers in .gpu-logs, in this checkout): setup x3 as in 06i,
# data with SELF_SEED=18 carrying .device/bin .gpu .gpu-logs/kernel-caches.tar.xz and parts aa, ab (the rest as in 06i),
# train carrying .device/bin and parts ac, ad, ae with `echo '{"n17": {"draft_vocab_size": 32000, "ttt_steps": 4, "lr":
# 0.001, "draft_intermediate_size": 6144, "init_from": "/tmp/init-drafter/n16"}}' > /tmp/grid-n17.json &&
# GRID=/tmp/grid-n17.json INIT_FROM=parts:n16 STORE=extraction TRAIN_MINUTES=7 TRIM=16000 DRAFTER_NAME=n17 ... train`,
# then the gate with the order reversed: DRAFTERS="n17-t16000 n17" (if the trimmed head is still the cheaper served
# first, the saving is the head's). By the same arithmetic n14 (accept 4.54, 1.47x) trimmed would have run at ~1.52x: a
# continued drafter with the trimmed head is the plan for the 1.5x cell.
# 2026-12-07 (session 63): no machine came (fourteen refused starts and eight calls inside the wait, 00:12-02:19 UTC,
# took 1,561 of the 1,800 s; the 239 left start none), so the n17 plan above is still next. Where a window is too
# short for data + train (under ~1,450 s), time shapes with no training instead: setup x2 (the kit; gguf1), then one
# bench call carrying .device/bin .device/gguf2 .gpu/mt-bench.jsonl (63 MB with the tree) with
# DRAFTERS="untrained:16000x6144 untrained:32000x6144 untrained:16000x6144" STEPS=7 TOPK=8 DRAFT_TOKENS=48 LEVELS=1
# SETS=mt-bench NUM_PROMPTS=16 ROUNDS=2 (the same shape first and last answers the order question, the middle one
# the head's cost; the untrained branch builds its drafters in seconds, seeded, so a name served twice is the same
# drafter: checked on the CPU with SmolLM2, 16000x3072 and 32000x6144 exported as 34 and 63 MB). The tree shapes
# replayed for n16-t16000 (results/2026-12-07-cpu): 7x8 with 32, 40, 48, 64 tokens 3.77, 3.85, 3.93, 4.03; 8x8x48
# 3.96; 7x16x48 3.97: 32 tokens pay only if verify saves more than ~0.15 ms of the cycle (its tree attention was
# 0.66 ms for 48).
# n17 (results/2026-12-07b-h100, session 64: eight refused starts took 736 s, an H100 came at 03:37 UTC): the n17 plan
# cut to fit ~1,000 s: setup x3 (36 s), data (EXTRACT_S=290 STOP_VALIDATE_S=40 in a 430-s call, SELF_COUNT=12000 seed 18:
# launch 46 s with the kernel caches restored, 200 s of stream, 16,757 samples, 7.9M tokens; 341 s), train
# (TRAIN_MINUTES=4.5 in a 360-s call: 1,255 steps, 39.2M tokens at 189K tok/s; 275 s), then the gate for n17-t16000
# alone (ROUNDS=2, 167 s). Accept 4.34 (n16-t16000 4.18), 1.43x (rounds 1.433, 1.419), a cycle 3.73 and 3.91 ms,
# 3.04 baseline steps: the same cycle as n16-t16000's and as n14's untrimmed head on 2026-12-06g (3.72-3.89 ms, 3.09
# steps), so the trimmed head saves little (the ~1.52x for a trimmed n14 above does not hold) and speed now moves with
# accept: 1.5x needs ~4.56 at 3.04 steps. The CPU replay of /tmp/off/n16-mt read 4.09 (n16-t16000 3.93): live 6%
# above it for both, so it ranks this lineage.
# Next: continue n17 (.gpu-drafters/parts-n17 and seed 18's answers in .gpu-logs, in this checkout) as n18, as the n17
# plan above with SELF_SEED=19, parts-n17 in place of parts-n16, init_from /tmp/init-drafter/n17, DRAFTER_NAME=n18,
# the full data call (EXTRACT_S=425) and TRAIN_MINUTES=7 where ~1,450 s are left, the cut one above where ~1,000 are;
# gate DRAFTERS="n18-t16000" alone (167 s) and, with time left, n18 at steps 3 on all sets (the cells' shape).
# 2026-12-07 (session 65): no machine came (thirteen refused starts, 04:40-06:25 UTC, took 1,531 of the 1,800 s: 90 s
# each, 180 s where one call tried H100 and then H200; the 269 left start none), so the n18 plan above is still next.
# On the CPU meanwhile (results/2026-12-07c-cpu): n17-t16000 replayed in 64-token trees reads 7x8x64 +2.5%, 7x10x64
# +3.1%, 8x8x64 +4.3% over 7x8x48 (4.09): none reaches the ~5% at no extra cost that 1.5x lacks; the soup of n16 and
# n17 reads 4.06 (no). Where a window is too short for data + train but holds ~450 s: n17-t16000's export is in this
# checkout as .gpu-drafters/parts-n17-t16000 (3 parts, 44.7 MB): setup x3 (the kit; gguf1; gguf2 with
# .gpu-logs/kernel-caches.tar.xz), then DRAFTERS=parts:n17-t16000 STEPS=7 TOPK=8 DRAFT_TOKENS=64 LEVELS=1
# SETS=mt-bench ROUNDS=2 bench carrying .device/bin .gpu and the 3 parts (61 MiB with the tree; the first launch of a
# machine ~45 s more): the 7x8x64 neighbour live, then DRAFTERS=/tmp/init-drafter/n17-t16000 with DRAFT_TOKENS=48
# beside it on the same machine.
# 2026-12-07 (session 66, results/2026-12-07d-h100): eight refused starts took 811 s; an H100 came at 07:46 UTC with
# 895 s left, so the gate-only plan ran instead of n18: n17-t16000 in four shapes on one machine (each ~163 s), 7x8x48
# 1.40x (accept 4.31, 3.08 steps), 7x8x56 1.42x (4.45, 3.13), 8x8x64 1.40x (4.45, 3.17), 6x8x49 1.47x (4.12; a slow
# second baseline round, ~1.37x over the window's median baseline, as 8x8x64; 7x8x48 and 7x8x56 ~1.45x on it). 7x8x64
# was refused by SpecConfig's old bound (topk*steps+1; SGLang's is topk + (steps-1)*topk^2, fixed in e968ad0). The shape
# is a plateau: the 1.5x cell needs a better drafter, so the n18 plan above is still next (7x8x56 beside 7x8x48 on the
# gate is cheap to keep checking). In hindsight the cut n18 plan fitted: once a machine is up, setup x2 + data + train
# are ~680 s of calls (session 64: 45 + 341 + 275) and the train call returns n18's parts, so the gate can wait for the
# next window; run the cut n18 plan whenever ~720 s are left after the first setup, the gate too where ~900 s are.
# 2026-12-07 (session 67, results/2026-12-07e-h100): an H100 at once. The split-KV verify kernel (`kernel`, 23 s) is
# correct (no error over SGLang's kernel's against float64) and per call 1.4-5.3x faster at batch 1 (prefix 100-1000),
# 0.6-1.8x at batch 16; served (n17-t16000, 7x8x48, MT-Bench c=1) it changed nothing measurable: 1.40x and 3.06
# baseline steps a cycle (3.76 ms) against SGLang's kernel's 1.40x and 3.07 (3.70 ms) in the next call, 3 rounds each
# (a 2-round pair before them read 1.28x/1.36x, the first on a machine whose baseline moved 763 -> 645 tok/s between
# rounds). Then the cut n18 plan: data (SELF_SEED=19, 12K prompts, 12,115 samples validated, 323 s) and train (n18 from
# n17, 1,208 steps in 224 s): offline +0.05-0.10 at depth 7 on the eval sets, CPU tree replay 4.22 vs n17's 4.15.
# Next window: setup x3 (the kit; gguf1; gguf2 + .gpu-logs/kernel-caches.tar.xz), a setup with .device/bin and
# .gpu-drafters/parts-n18-t16000's 3 parts (trimmed here with seed 19's answers), then ONE side-by-side grid:
# SIDE_BY_SIDE=1 DRAFTERS="parts:n17-t16000 parts:n18-t16000" STEPS=7 TOPK=8 DRAFT_TOKENS=48 LEVELS=1 SETS=mt-bench
# ROUNDS=4 bench carrying .device/bin .gpu and parts-n17-t16000's 3 parts (~200 s); then the trees side by side:
# DRAFTERS=/tmp/init-drafter/n18-t16000 SHAPES=7x8x48,6x10x64,6x12x80,7x8x64 LEVELS=1 SETS=mt-bench ROUNDS=4 bench
# (carry .device/bin .gpu; five servers, ~300 s). The CPU replays n18-t16000's 6x10x64 at 4.19 as its 7x8x48 (one
# draft step fewer) and 6x12x80 at 4.25 (results/2026-12-07e-h100): where a draft step costs the cycle more than verify
# tokens do (6x8x49 2.80 vs 7x8x48 3.08 baseline steps, 7x8x56 3.13: one noisy pair each), they are the 1.5x
# candidates. And, with time left,
# VERIFY_KERNEL=sglang,splitkv on the better one (the kernel side by side in shared rounds; or, to see where its time
# goes, DRAFTERS=/tmp/init-drafter/n17-t16000 STEPS=7 TOPK=8 DRAFT_TOKENS=48 VERIFY_KERNEL=splitkv ONLY=eagle3 profile,
# ~100 s: the verify phase's kernels beside 06g's SGLang _fwd_kernel, 660 us a cycle of the phase's 1.58 ms on the
# GPU, the cycle's 2.9 ms of GPU time in a ~3.7-ms cycle). With ~750 s left after
# that: the cut plan again for n19 (SELF_SEED=20; data carrying .device/bin .gpu .gpu-logs/kernel-caches.tar.xz and
# .gpu-drafters/parts-n18's aa, ab; train with INIT_FROM=parts:n18, "init_from": "/tmp/init-drafter/n18" in the grid,
# carrying ac, ad, ae), and a side-by-side gate of n19-t16000 and n18-t16000 if ~250 s remain.
# 2026-12-07 (session 68, results/2026-12-07f-h100): one refused start (91 s), then an H100 named nvidia-h100-x1 at
# once. setup x4 (gguf2 with the kernel caches and the 14.5-MB tree passed 64 MiB: carry the caches with a bench or
# data call), then n18-t16000's trees in two calls of four rounds (DRAFTERS=parts:n18-t16000 SHAPES=...: 343-420 s for
# five servers): 6x10x64 1.44x twice (accept 4.39, 3.04 baseline steps, 3.53 ms), 1.064x 7x8x48's tok/s in shared
# rounds; 6x12x80, 7x8x64, 5x10x64, 6x10x48, 5x12x64 0.95-1.00x of it. 6x10x64 is SGLANG_BEST now. The cut n19 plan
# (seed 20: 12,949 samples; n19 1,216 steps in 206 s) and n19-t16000 (trimmed here by the extraction's counts) at
# 6x10x64 alone in 2 rounds: 1.41x, accept 4.29, where the CPU replay reads n19-t16000 (trimmed on seed 20's answers)
# 4.27 and n19 4.33 against n18-t16000's 4.19. At 3.04 steps a cycle, 1.5x needs accept 4.56; n14 accepted
# 4.54-4.58 as 7x8x48, this lineage (n16 from nothing) 4.18-4.34: the drafter is the lever left.
# Next window: setup x3 (the kit; gguf1; gguf2), a setup with .device/bin and .gpu-drafters/parts-n18-t16000's three
# parts, then the verify kernels side by side at the new default tree (64 verified tokens, the verify's attention a
# larger share than at 7x8x48's 48, where splitkv changed nothing measurable between two calls): VERIFY_KERNEL=sglang,
# splitkv DRAFTERS=parts:n18-t16000 STEPS=6 TOPK=10 DRAFT_TOKENS=64 LEVELS=1 SETS=mt-bench ROUNDS=3 bench (carry
# .device/bin .gpu; ~200 s); then a setup with .device/bin and .gpu-drafters/parts-n19's aa, ab
# (.gpu-logs/kernel-caches.tar.xz beside them), then a full data call for n20 (SELF_COUNT=18000 SELF_SEED=21
# STARTER_SET="kinds code creative" SOURCE=train-1tc.jsonl.xz LIMIT=40000 STORE=extraction EXTRACT_S=400
# STOP_VALIDATE_S=50 timeout -k 10 -s TERM 560, carrying .device/bin .gpu + parts-n19 ac, ad: ~20K samples), train
# (grid {"n20": {..., "init_from": "/tmp/init-drafter/n19"}} INIT_FROM=parts:n19 TRAIN_MINUTES=5.5 TRIM=16000
# DRAFTER_NAME=n20, carrying .device/bin + parts-n19 ae), then n20 against n19 untrimmed at the default tree:
# SIDE_BY_SIDE=1 DRAFTERS="n20 /tmp/init-drafter/n19" STEPS=6 TOPK=10 DRAFT_TOKENS=64 LEVELS=1 SETS=mt-bench ROUNDS=3
# bench (~200 s; /tmp/init-drafter/n19 exists once INIT_FROM=parts:n19 unpacked it).
# n15 over n14 is not paired yet (a CPU replay of one 40-prompt MT-Bench capture reads them equal: 2.58 at steps 3):
# two drafters are compared by serving both in one bench call (DRAFTERS="A B": B on MT-Bench beside the same
# baseline) and running scripts/paired_answers.py over their report.json files (the answers both wrote alike).
# What a step reports (JSON, logs, every command line in commands.txt) comes back as ONE file, $OUT/STEP.tgz
# (a call returns at most 8 files, two folders deep); the train step adds the first drafter in <= 15 MB parts, the
# data step the target's answers (regen-logs-TAG.tar.xz.part*: put them in .gpu-logs/, carry it in the second setup
# call, and the next data step with the same SOURCE, MAX_TURNS and LIMIT captures them without regenerating).
# Knobs (environment): SOURCE (a file of .gpu/: train-1tc.jsonl.xz, `make gpu-inputs`' 10K ShareGPT first turns with
# 2,777 coding prompts spread through them; train-mt.jsonl.xz from
# `scripts/pack_prompts.py --count 20000 --max-tokens 2048 --max-turns 8 --exclude-prompt-set ...` x3 is 12,655
# conversations, 10.5 MB; train-mtx.jsonl.xz spreads `scripts/pack_code_prompts.py --spread`'s 2,777 coding prompts
# through it, 10.6 MB: carry one of them instead of train-1tc, the call holds 64 MiB), MAX_TURNS (1), LIMIT (10000), CONC (1024), NUM_SERVERS (2: they share the GPU, 0.7 of it in all, and the run streams from the first ready one; 10K first turns in 128 s after it), EXTRACT (1; 0 skips it), EXTRACT_S (420; after it the extraction stops its servers and validates what it captured for up to STOP_VALIDATE_S, 60: on the H100 on 2026-12-05, 5,749 of 14,669 captured samples were not validated when the budget ended; VALIDATE_CHUNK, 512: samples per validation chunk, the ledger's unit, 4096 before: a 2,535-sample chunk took 45 s there), PROFILE (0; 1: nvidia-smi dmon + stack samples of SGLang's scheduler and HTTP
# processes and of the extraction's request loop and validation during the extraction: profile.json, and each
# second's top functions in prof/*.timeline.jsonl; in train, one profiled training step first: train-profile.txt), FP8 (0; 1: also an fp8 store), STORE (bf16; fp8: the one store data writes and train reads; extraction: no store, train reads the extraction folder), ANSWERS_FROM (the tag of carried answers of other turns/limit), CAPTURE_CALIB (1: the extraction's servers capture the eval prompts first, ~15 s; separate: a server of its own, 80-150 s; 0: none), CHUNKED_PREFILL (8192), SGL_EXTRA (more SGLang flags, space-separated: the extraction's servers and both bench servers), BASELINE_EXTRA (bench: more flags for the baseline server only, after SGL_EXTRA, e.g. "--attention-backend flashinfer": its fastest backend need not be EAGLE3's), VERIFY_KERNEL (bench: sglang, the EAGLE3 server's own tree-verify attention; splitkv: eaglenest's split-KV kernel through the plugin, EAGLENEST_VERIFY_SPLITS prefix slices, 8), EPOCHS (auto: epochs, in tenths, that
# finish in 85% of TRAIN_MINUTES at TRAIN_TOK_S per config, by card and KL kernel in the train step: one config alone; less for two at once), TRAIN_MINUTES (8.5,
# a safety stop), GRID (a gpu_sweep grid JSON, default one config named DRAFTER_NAME: TTT 4, lr 2e-3, draft vocab 16000, draft MLP 6144),
# DRAFTER_NAME (wide: the default grid's drafter; e.g. n11 brings the parts back as drafter-n11.tar.part*, ready for
# INIT_FROM=parts:n11 in the next window without repacking), INIT_FROM (train: continue
# from this exported drafter, carried with the call, or parts:NAME: from its parts; with GRID, name init_from
# /tmp/init-drafter/NAME in it), AVERAGE (train: 0; 1 with INIT_FROM: also NAME-avg, its average with the drafter it
# continued), TRIM (train: none; N: also NAME-tN, its draft vocabulary cut to N tokens), STARTER_SET (prompts: kinds; "kinds code" adds functions to complete, "creative" more writing and roleplay; empty: free prompts), DRAFTERS
# (the last train call's drafters, else wide; the first on every prompt set unless SETS=mt-bench; parts:NAME: a drafter from its parts, carried as for
# INIT_FROM, served before any data call with gguf2 and .gpu carried; NAME-tN: NAME's head trimmed to N tokens here, as TRIM=N makes it; best: all the train step's drafters, the best by offline MT-Bench @3 first), NUM_PROMPTS (40: per prompt set, live in bench and captured for the offline side in data), STEPS (3), TOPK (1: a chain; more: an EAGLE-2 tree of DRAFT_TOKENS, root counted), LEVELS (1,16: concurrencies), ROUNDS (1; R > 1: baseline and EAGLE3 up together, every level in R alternating rounds), CALIB (0), KL_AB (train: 0; 1 also times the Triton KL kernels against the PyTorch ops before training), KL_KERNEL (train: auto, the kernels once checked on this GPU, the faster with KL_AB=1; triton; torch). Timings seen on the H200: setup
# 5 s; data 40 s model + 120 s launch (200 s on a machine that just started: Triton compiles the CUDA graphs' kernels;
# 90 s for the next launch) + the extraction (10K first turns with cut answers kept: more than 440 s)
# + 26 s store + 90 s calibration capture; train 86.7K tok/s for one config; bench: baseline launch 146 s, each
# EAGLE3 launch about 80 s, 40 MT-Bench prompts x 256 at c=1,16 about 40 s a level; the machine goes cold 30 s
# after a call returns (then setup, the model and the store are gone): have the next call ready before.
set -euo pipefail
STEP=${1:?usage: gpu_session.sh setup|prompts|data|train|bench|profile|kernel|specforge}
OUT=${OUT:-/tmp/out}
W=/tmp/eaglenest-session
R=$W/results/$STEP
mkdir -p "$OUT" "$R"
SAMPLER=  # bench: the host sampler's PID
stop_sampler() {  # once, where the bench ends and in finish (a call that fails must not leave it running)
  if [ -n "$SAMPLER" ]; then kill "$SAMPLER" 2>/dev/null || true; wait "$SAMPLER" 2>/dev/null || true; SAMPLER=; fi
}
finish() {  # the one EXIT trap (under set -e a failing command in it would end it before the packing)
  stop_sampler
  cp "$W/commands.txt" "$R/" 2>/dev/null || true; tar -C "$W/results" -czf "$OUT/$STEP.tgz" "$STEP"
}
trap finish EXIT
# shellcheck disable=SC1091
source .device/bin/device_setup.sh
export PYTHONPATH="/tmp/site:$PWD"
SGL_MORE=(); for a in ${SGL_EXTRA:-}; do SGL_MORE+=("--sglang-arg=$a"); done  # SGL_EXTRA: more SGLang flags, spaced
BASE_MORE=(); for a in ${BASELINE_EXTRA:-}; do BASE_MORE+=("--baseline-sglang-arg=$a"); done  # the baseline's own
SGL=(--sglang-arg=--attention-backend --sglang-arg=triton --sglang-arg=--sampling-backend --sglang-arg=pytorch
     "${SGL_MORE[@]}")
MODEL=/tmp/smol/model
NUM_PROMPTS=${NUM_PROMPTS:-40}  # prompts per set: decoded live by bench, the same ones captured for the offline side
case "$NUM_PROMPTS" in ''|*[!0-9]*) echo "NUM_PROMPTS must be a whole number, got '$NUM_PROMPTS'" >&2; exit 2 ;; esac
[ "$NUM_PROMPTS" -le 80 ] || { echo "NUM_PROMPTS $NUM_PROMPTS > 80: calib.jsonl holds 80 prompts per set" >&2; exit 2; }
STORE=${STORE:-bf16}  # the training store's encoding (fp8: half the disk, trained the same within noise), or
# `extraction`: no store, training reads the extraction folder in place (all the disk goes to shards: ~13M tokens)
TRAIN_DATA=/tmp/store-$STORE; [ "$STORE" != extraction ] || TRAIN_DATA=/tmp/ext/regen

baseline_flags() {  # SGL_EXTRA without the flags of speculation (and their values), then BASELINE_EXTRA: what a
  # baseline server runs with (a cached baseline is reused only by a bench whose baseline runs the same)
  local out=() skip=0 a
  for a in ${SGL_EXTRA:-}; do
    if [ "$skip" = 1 ] && [ "${a#--}" = "$a" ]; then skip=0; continue; fi
    skip=0
    case "$a" in --speculative-*=*) ;; --speculative-*) skip=1 ;; *) out+=("$a") ;; esac
  done
  printf '%s' "${out[*]}${BASELINE_EXTRA:+ | $BASELINE_EXTRA}"
}

baseline_covers() {  # $1 a baseline JSON, $2 another: does $1 hold every prompt set and level of $2?
  python3 -c "import sys
from eaglenest.speculative.baseline import baseline_covers
sys.exit(0 if baseline_covers(*sys.argv[1:3]) else 1)" "$1" "$2"
}

grid_names() {  # $1 a gpu_sweep grid JSON: its configs' names, which are also its drafters' names
  python3 -c "import json,sys; print(' '.join(json.load(open(sys.argv[1]))))" "$1"
}

run() {  # log the exact command line, then run it
  echo "$(date -u +%FT%TZ) $*" | tee -a "$W/commands.txt" >&2
  "$@"
}

ensure_model() {  # the target from its two GGUF halves (setup brought the first), once per machine
  [ ! -f "$MODEL/config.json" ] || return 0
  [ -f /tmp/smol/smol.part00 ] || { echo "no first GGUF half yet: a setup call with .device/gguf1 first" >&2; exit 2; }
  [ -f .device/gguf2/smol.part01 ] || { echo "no model yet: carry .device/gguf2 in this call" >&2; exit 2; }
  cp .device/gguf2/smol.part01 /tmp/smol/
  run python3 scripts/gpu_run.py --phases model --work /tmp/smol --gguf-parts /tmp/smol/smol.part00 /tmp/smol/smol.part01
}

serve_inputs() {  # what bench and profile serve: the target, and the prompt sets from .gpu (kept from an earlier call)
  ensure_model; [ -d /tmp/gpu ] || cp -r .gpu /tmp/gpu
}

copy_logs() {  # what .gpu-logs carries (prompt packs, earlier answers: read-only files) to /tmp/gpu-logs
  [ -d .gpu-logs ] || return 0
  mkdir -p /tmp/gpu-logs && find .gpu-logs -maxdepth 1 -type f -exec cp -f -t /tmp/gpu-logs/ {} + && ls -la /tmp/gpu-logs
}

copy_parts() {  # drafter parts (drafter-NAME.tar.part*, as train sends them back) that .gpu-drafters/parts* carries
  local f; mkdir -p /tmp/drafter-parts
  for f in .gpu-drafters/parts*/drafter-*.tar.part*; do [ -f "$f" ] && cp -f "$f" /tmp/drafter-parts/; done; return 0
}

resolve_draft() {  # $1 a drafter: a train call's name (or NAME-tN), a folder, parts:NAME, or untrained:VOCABxMLP (e.g.
  # untrained:32000x6144: an untrained drafter of that draft vocabulary and MLP width (its head the target's rows, as
  # init=target starts, built here in seconds): what a speculation cycle costs for a drafter's shape needs no training,
  # so shapes are timed without data); sets draft (its folder) and name
  name=$1; draft=/tmp/export/$name; [ -d "$name" ] && draft=$name && name=$(basename "$name")
  case "$name" in */*) echo "$1: no drafter folder on this machine (carried parts are unpacked by naming them \
parts:NAME; a folder such as /tmp/init-drafter/NAME exists only after a call that did so)" >&2; exit 2 ;; esac
  if [ "${name#parts:}" != "$name" ]; then copy_parts; draft=$(init_drafter "$name"); name=${name#parts:}; fi
  if [ "${name#untrained:}" != "$name" ]; then
    local shape=${name#untrained:}
    case "$shape" in [0-9]*x[0-9]*) ;; *) echo "$1: want untrained:VOCABxMLP, e.g. untrained:32000x6144" >&2; exit 2 ;;
    esac
    name=untrained-$shape; draft=/tmp/export/$name
    run python3 scripts/gpu_check_export.py --target "$MODEL" --random --draft-vocab "${shape%x*}" \
      --draft-mlp "${shape#*x}" --export-to "$draft" --export-only > "$R/$name.json"
  fi
  # NAME-tN that no call has made while this machine holds NAME: NAME's head trimmed to N tokens here, as TRIM=N in
  # train makes it (other sizes than train's in the same bench call, e.g. DRAFTERS="n16-t16000 n16-t12000")
  if [ ! -d "$draft" ] && [[ $name =~ ^(.+)-t([0-9]+)$ ]] && [ -d "/tmp/export/${BASH_REMATCH[1]}" ]; then
    trim_export "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" || { echo "$1: the trim failed" >&2; exit 2; }
  fi
  return 0
}

trim_export() {  # $1 an exported drafter's name, $2 N: /tmp/export/NAME-tN, its draft head cut to the N tokens most
  # frequent in the training data on this machine (`eaglenest trim-vocab`: the store train read, else the extraction)
  local counts=$TRAIN_DATA; [ -e "$counts" ] || counts=/tmp/ext/regen
  [ -e "$counts" ] || { echo "trim $1 to $2: no training data on this machine to count ($TRAIN_DATA, /tmp/ext/regen)" \
    >&2; return 2; }
  run python3 -m eaglenest trim-vocab "/tmp/export/$1" "/tmp/export/$1-t$2" --size "$2" --counts-from "$counts" \
    --overwrite > "$R/trim-$1-t$2.json"
}

init_drafter() {  # $1 INIT_FROM: an exported drafter folder, or parts:NAME (its parts, carried over several calls)
  local name=${1#parts:}
  [ "$name" != "$1" ] || { realpath "$1"; return; }
  ls /tmp/drafter-parts/drafter-"$name".tar.part* >/dev/null 2>&1 \
    || { echo "INIT_FROM=$1: no /tmp/drafter-parts/drafter-$name.tar.part* (carry .gpu-drafters/parts*/...)" >&2; exit 2; }
  rm -rf "/tmp/init-drafter/$name" && mkdir -p /tmp/init-drafter  # (others stay: SIDE_BY_SIDE serves several)
  cat /tmp/drafter-parts/drafter-"$name".tar.part* | tar -C /tmp/init-drafter -xf - || { echo "INIT_FROM=$1: \
the parts do not unpack (one missing?): $(ls /tmp/drafter-parts)" >&2; exit 2; }
  echo "/tmp/init-drafter/$name"
}

# Kernels a fresh machine compiles during its first launch. Triton's cache alone did not make that launch fast: with it
# restored the first server's decode-graph capture still took 59.5 s (2026-12-05e) and 63.4 s (2026-12-06d), the
# second server's 4.5-6.1 s, so the rest of what it compiles is kept elsewhere (the CUDA driver's PTX cache
# ~/.nv/ComputeCache, JIT caches under ~/.cache, TorchInductor's under /tmp). `data` and `bench` list the caches'
# sizes ($R/kernel-caches.txt) and bring back all of them that fit one file ($OUT/kernel-caches.tar.xz, paths from
# /; else Triton's alone); a later session carries the file in .gpu-logs (setup or data), or an older
# triton-cache.tar.xz (Triton's cache alone, from its root)
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
kernel_cache_dirs() {  # $1 a root ('' for this machine's own /): the kernel caches found under it, one a line,
  # each once and none inside another listed one (TRITON_CACHE_DIR may point under ~/.cache)
  local d i j found=()
  for d in "$1$TRITON_CACHE" "$1$HOME/.nv/ComputeCache" "$1$HOME"/.cache/* "$1"/tmp/torchinductor_*; do
    case "$d" in */.cache/pip|*/.cache/huggingface) continue ;; esac
    if [ -d "$d" ] && [ ! -L "$d" ]; then found+=("$d"); fi
  done
  for ((i = 0; i < ${#found[@]}; i++)); do
    for ((j = 0; j < ${#found[@]}; j++)); do  # the same folder again, or one inside another: the outer one, once
      if [ "$j" -lt "$i" ] && [ "${found[j]}" = "${found[i]}" ]; then continue 2; fi
      case "${found[i]}" in "${found[j]}"/*) continue 2 ;; esac
    done
    echo "${found[i]}"
  done
  return 0
}
restore_kernels() {  # never fails the step: a file that does not unpack, or a cache that cannot move, is left out
  # (any setup call may carry the file: each cache moves in only where this machine has none of its own yet; the
  # first call's 64 MiB no longer hold the kit, the working tree and a kernel-cache file of 6.6 MB together)
  local f d to moved tmp=/tmp/kernel-caches.unpack
  for f in .gpu-logs/kernel-caches.tar.xz .gpu/kernel-caches.tar.xz; do
    [ -f "$f" ] || continue
    rm -rf "$tmp"; mkdir -p "$tmp"
    if ! tar -C "$tmp" -xJf "$f"; then echo "kernel caches: $f did not unpack" >&2; rm -rf "$tmp"; continue; fi
    moved=
    while read -r d; do  # each cache moves into place whole, where this machine has none yet
      to=${d#"$tmp"}
      [ ! -e "$to" ] || continue
      if { mkdir -p "$(dirname "$to")" && mv "$d" "$to"; } 2>/dev/null; then moved+=" $to"
      else echo "kernel cache $to left out: it did not move into place" >&2; rm -rf "$to"; fi
    done < <(kernel_cache_dirs "$tmp")
    rm -rf "$tmp"
    echo "kernel caches restored from $f:${moved:- none (another HOME?)}"
    return 0
  done
  for f in .gpu-logs/triton-cache.tar.xz .gpu/triton-cache.tar.xz; do  # the older file: Triton's cache alone
    [ -f "$f" ] && [ ! -d "$TRITON_CACHE" ] || continue
    rm -rf "$tmp"; mkdir -p "$tmp" "$(dirname "$TRITON_CACHE")" 2>/dev/null || continue
    if tar -C "$tmp" -xJf "$f" && mv "$tmp" "$TRITON_CACHE"; then echo "triton cache restored from $f"
    else echo "triton cache: $f did not unpack; compiling anew" >&2; rm -rf "$tmp"; fi
  done
  return 0
}
KERNEL_CACHES_MAX_KB=204800  # caches above this, uncompressed, are not packed whole (xz of ~200 MB: a minute or more)
pack_caches() {  # paths relative to /: packed into /tmp/kernel-caches.tar.xz; fails when that is not one file of 15 MB
  { tar -C / -cf - "$@" | xz -T0 -6 > /tmp/kernel-caches.tar.xz; } && [ "$(stat -c %s /tmp/kernel-caches.tar.xz)" -le 15000000 ]
}
save_kernels() {  # never fails the step either
  local dirs=() rels=() d kb
  mapfile -t dirs < <(kernel_cache_dirs '')
  [ "${#dirs[@]}" -gt 0 ] || return 0
  du -s "${dirs[@]}" > "$R/kernel-caches.txt" 2>/dev/null || true
  kb=$(du -sc "${dirs[@]}" 2>/dev/null | tail -1 | cut -f1) || kb=0
  for d in "${dirs[@]}"; do rels+=("${d#/}"); done
  if [ "${kb:-0}" -gt "$KERNEL_CACHES_MAX_KB" ] || ! pack_caches "${rels[@]}"; then
    echo "kernel caches: $kb KB before compression (at most $KERNEL_CACHES_MAX_KB) or over 15 MB packed; Triton's alone" >&2
    [ -d "$TRITON_CACHE" ] || return 0
    pack_caches "${TRITON_CACHE#/}" || { echo "Triton's cache did not either" >&2; return 0; }
  fi
  cp /tmp/kernel-caches.tar.xz "$OUT/" || true
  return 0
}

machine_state() {  # $1 a file: what the host and the GPU are doing (EAGLE3's cycle cost at 1 request is host-bound and
  # has moved 1.5x between machines: 3.1 ms on 2026-12-03e, 4.3 ms on 2026-12-05e, same flags and drafter shape)
  { date -u; lscpu | grep -E 'Model name|^CPU\(s\)|MHz' || true; cat /proc/loadavg
    echo "nproc $(nproc); cgroup cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"
    ps -eo pid,pcpu,rss,etimes,comm --sort=-pcpu | head -12 || true
    nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used \
      --format=csv || true
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv || true
    nvidia-smi -q -d PERFORMANCE | grep -A12 'Clocks Event Reasons' || true; } > "$1" 2>&1
}

host_samples() {  # $1 a file: every 10 s while a bench measures, what the host runs now (top's second frame: the last
  # second's %CPU), the core each SGLang/Python process last ran on (psr) and the GPU's clock. EAGLE3's cycle at 1
  # request is host-bound and differed 15-20% between two launches of one shape in one call (2026-12-06d, e: the
  # drafter served first ran slower a cycle than the next); these samples beside the servers' logs say whether the
  # host was busy, or its processes shared cores, when it did. Runs until killed; a failed probe skips a line.
  set +e +o pipefail
  while :; do
    { echo "== $(date -u +%T) load $(cat /proc/loadavg)"
      top -b -n 2 -d 1 -w 160 2>/dev/null | awk '/^top -/ {n++} n == 2' | sed -n '7,15p'
      ps -eo pid,psr,pcpu,etimes,args --sort=-pcpu | grep -E '[s]glang|[p]ython' | cut -c1-150 | head -12
      nvidia-smi --query-gpu=clocks.sm,power.draw,utilization.gpu --format=csv,noheader || true; } >> "$1" 2>&1
    sleep 9
  done
}

send_back() {  # $1 an exported drafter of /tmp/export, in parts of <= 15 MB, when $OUT then holds at most $2 files
  local have parts
  have=$(find "$OUT" -maxdepth 1 -type f | wc -l)
  parts=$(( ($(du -sb "/tmp/export/$1" | cut -f1) + 15728639) / 15728640 ))
  [ $((have + parts)) -le "$2" ] || return 1
  tar -C /tmp/export -cf - "$1" | split -b 15M - "$OUT/drafter-$1.tar.part"
}

case "$STEP" in
setup)
  mkdir -p /tmp/smol; if [ -d .device/gguf1 ]; then cp .device/gguf1/smol.part00 /tmp/smol/; fi; ls -la /tmp/smol
  # what the data call has no room for (its 64 MiB are taken by gguf2 and .gpu) travels in .gpu-logs with a setup
  # call: the target's answers of an earlier session (regen-logs-TAG.tar.xz.part*) and prompt packs (*.jsonl.xz,
  # found by SOURCE like those of .gpu)
  copy_logs
  copy_parts
  restore_kernels
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$R/gpu.txt"
  machine_state "$R/machine-setup.txt"
  # does a process outlive its call? (if so, a second data call could reuse the first one's servers: ~90 s of launch)
  if [ -f /tmp/survivor.pid ] && [ "$(awk '{print $3}' "/proc/$(cat /tmp/survivor.pid)/stat" 2>/dev/null)" = S ]; then
    echo "pid $(cat /tmp/survivor.pid), started by an earlier call, is still alive" | tee "$R/survivor.txt"
  else
    [ ! -f /tmp/survivor.pid ] || echo "pid $(cat /tmp/survivor.pid) of an earlier call is gone" | tee "$R/survivor.txt"
    setsid nohup sleep 1700 > /dev/null 2>&1 < /dev/null & echo $! > /tmp/survivor.pid
  fi
  git -C . log -1 --format=%H 2>/dev/null | tee "$R/commit.txt" || true
  [ ! -f .device/gguf2/smol.part01 ] || ensure_model  # gguf2 in a setup call of its own: data then carries .gpu alone
  ;;
data)
  rm -rf /tmp/gpu && cp -r .gpu /tmp/gpu
  copy_logs  # a pack or earlier answers may come with this call too, when it has room (no gguf2)
  copy_parts  # so may a drafter's parts for the train call after it (a setup call fewer)
  restore_kernels
  src=${SOURCE:-train-1tc.jsonl.xz}; [ -f "/tmp/gpu/$src" ] || cp "/tmp/gpu-logs/$src" /tmp/gpu/ || true
  # the target's answers of an earlier session with the same source, turns and limit (.gpu/regen-logs-TAG.tar.xz.part*,
  # from this step's $OUT): those samples need only their capture, so regeneration goes to prompts not answered yet
  tag="$(basename "$src" .jsonl.xz)-t${MAX_TURNS:-1}-l${LIMIT:-10000}"
  if [ "${SELF_COUNT:-0}" -gt 0 ]; then tag="$tag-self${SELF_SEED:-0}x$SELF_COUNT"; fi
  # ANSWERS_FROM=TAG: the answers of a run with other turns or limit (e.g. train-mtx-t3-l15432 for MAX_TURNS=8): only
  # answers.jsonl is taken, so each turn it holds is replayed and the later turns are generated in their context
  from=${ANSWERS_FROM:-$tag}; only=(); [ "$from" = "$tag" ] || only=(answers.jsonl)
  for logs in .gpu /tmp/gpu-logs; do
    if ls "$logs"/regen-logs-"$from".tar.xz.part* >/dev/null 2>&1 && [ ! -f /tmp/ext/regen/answers.jsonl ]; then
      mkdir -p /tmp/ext/regen && cat "$logs"/regen-logs-"$from".tar.xz.part* \
        | tar -C /tmp/ext/regen -xJf - ${only[@]+"${only[@]}"} && ls -la /tmp/ext/regen
    fi
  done
  ensure_model  # (a second data call needs no gguf2)
  # the extraction gets EXTRACT_S seconds (SIGTERM: it stops its servers; what is validated stays) so the stores
  # and the calibration capture still fit in the call; `data` again resumes it (the stores are then rebuilt,
  # reusing every data file already written)
  # CAPTURE_CALIB (1): the target's greedy answers to the eval prompt sets captured for the offline side, by the
  # extraction's own servers before its samples (--eval-prompts: no launch of its own; the separate capture cost
  # 80-150 s), or by a separate capture when there is no extraction (EXTRACT=0) or CAPTURE_CALIB=separate; 0: none.
  # The first NUM_PROMPTS of each set: exactly the prompts the bench step decodes live (same files, same order)
  touch "$W/data-call.start"  # (what /tmp/calib holds from an earlier call is not this call's capture)
  case "${CAPTURE_CALIB:-1}" in
    0) calib_mode=none ;; separate) calib_mode=separate ;; 1) calib_mode=inline; [ "${EXTRACT:-1}" != 0 ] || calib_mode=separate ;;
    *) echo "CAPTURE_CALIB must be 1, separate or 0, got '$CAPTURE_CALIB'" >&2; exit 2 ;;
  esac
  [ "$calib_mode" = none ] || python3 -c "
import json
from collections import Counter
seen, keep = Counter(), []
for line in open('/tmp/gpu/calib.jsonl'):
    row = json.loads(line)
    seen[row['prompt_set']] += 1
    if seen[row['prompt_set']] <= $NUM_PROMPTS:
        keep.append(line)
open('/tmp/gpu/calib-first.jsonl', 'w').writelines(keep)" || { echo "no eval prompts (/tmp/gpu/calib.jsonl): no calibration capture" >&2
                                                         calib_mode=none; }
  extract() {  # $1 servers, $2 seconds
    local prof=() dmon=
    if [ "${PROFILE:-0}" = 1 ]; then  # where the time goes: GPU use each second, SGLang's scheduler/HTTP stacks
      prof=(env EAGLENEST_SAMPLE_PROFILE="$R/prof")
      nvidia-smi dmon -s um -d 1 -o DT > "$R/dmon.txt" 2>&1 &  # -o DT: each second's date and time
      dmon=$!
    fi
    # the store is written beside the shards (bf16: as many bytes again, fp8: half): when the free disk could not
    # hold it any more, the extraction is stopped like at the end of its budget (what is validated stays)
    local share=2  # half-units of the shards' bytes the stores still need: bf16 2, fp8 1, both 3, none 0
    [ "$STORE" = fp8 ] && share=1; [ "$STORE" = extraction ] && share=0
    [ "$STORE" = bf16 ] && [ "${FP8:-0}" = 1 ] && share=3
    ( while sleep 5; do
        used=$(du -sb /tmp/ext/regen 2>/dev/null | cut -f1 || true); free=$(df -B1 --output=avail /tmp | tail -1)
        need=$(( ${used:-0} * share / 2 + 4000000000 ))
        if [ "$free" -lt "$need" ]; then echo "disk: ${free} B free < ${need} B for the store; stopping the extraction" >&2
          pkill -TERM -f "^python3 -m eaglenest extract" || true; break; fi
      done ) &
    local guard=$!
    # SELF_COUNT (data): the extraction's own servers write that many prompts first (SELF_SEED, STARTER_SET as in
    # the prompts step), answered before SOURCE's records: one launch instead of the prompts call's and this one's
    local own=(); if [ "${SELF_COUNT:-0}" -gt 0 ]; then
      own=(--self-prompts "$SELF_COUNT" --self-seed "${SELF_SEED:-0}" --self-exclude-file .gpu/eval-user-texts.json)
      for set in ${STARTER_SET-kinds}; do own+=(--self-starter-set "$set"); done
    fi
    [ "$calib_mode" != inline ] || own+=(--eval-prompts /tmp/gpu/calib-first.jsonl --eval-output-dir /tmp/calib
                                         --eval-max-new-tokens 256)
    # after the TERM the run stops its servers (side by side, 10 s grace), validates for STOP_VALIDATE_S and writes
    # its report; -k bounds all of that, so the answers below are always packed inside the call (2026-12-05c on
    # the H100: the call's own limit came first, the answers were never packed, and the run outlived the script)
    run timeout -s TERM -k "$(( ${STOP_VALIDATE_S:-60} + 45 ))" "$2" ${prof[@]+"${prof[@]}"} python3 -m eaglenest extract --engine sglang --model "$MODEL" --source "/tmp/gpu/$src" \
      --limit "${LIMIT:-10000}" --max-turns "${MAX_TURNS:-1}" --max-tokens 2048 --recipe regenerate --regen-max-new-tokens 512 \
      --num-servers "$1" --concurrency "${CONC:-1024}" --batch-size "${VALIDATE_CHUNK:-512}" --stop-validate-s "${STOP_VALIDATE_S:-60}" \
      ${own[@]+"${own[@]}"} --output-dir /tmp/ext --extraction-id regen \
      "${SGL[@]}" --sglang-arg=--mem-fraction-static --sglang-arg=0.7 --sglang-arg=--chunked-prefill-size \
      "--sglang-arg=${CHUNKED_PREFILL:-8192}" 2> >(tee -a "$R/extract-progress.txt" >&2) || { local rc=$?; kill "$guard" 2>/dev/null || true
                                                                      [ -z "$dmon" ] || kill "$dmon"; return $rc; }
    kill "$guard" 2>/dev/null || true; [ -z "$dmon" ] || kill "$dmon"
  }
  if [ "${EXTRACT:-1}" != 0 ]; then
    t0=$(date +%s); budget=${EXTRACT_S:-420}
    extract "${NUM_SERVERS:-2}" "$budget" || echo "extract exited $?" >&2
    left=$((budget - $(date +%s) + t0))
    # servers sharing the GPU are new: when that launch fails early, the rest of the budget goes to one server
    if [ "${NUM_SERVERS:-2}" != 1 ] && [ ! -f /tmp/ext/regen/report.json ] && [ "$left" -gt 150 ]; then
      echo "retrying the extraction with one server for ${left} s" >&2; extract 1 "$left" || echo "extract exited $?" >&2
    fi
  fi
  cp /tmp/ext/regen/report.json "$R/extraction.json" 2>/dev/null || true
  cp /tmp/ext/regen/self-prompts.json "$R/" 2>/dev/null || true  # (SELF_COUNT: what the target wrote)
  # SGLang's own view of the extraction: its batch lines (running requests, tokens, throughput per window), its
  # arguments and CUDA-graph capture, to tell a starved decode batch from a slow one; and the launch's milestones (on
  # 2026-12-05e the first server's decode-graph capture took 59.5 s of a 116-s launch, the second's 6.1 s)
  for f in /tmp/ext/regen/logs/server-*.log; do
    [ -f "$f" ] || continue
    { grep -E "Decode batch|Prefill batch|server_args=|CUDA graph|Init torch|Load weight|KV Cache|Memory pool|fired up" \
        "$f" || true; } \
      | xz -T0 > "$R/$(basename "$f" .log)-batches.txt.xz"
  done
  # the answers come back (small next to the shards) so that the next session captures them without regenerating;
  # a copy stays in /tmp/gpu-logs for a later data call of this window (ANSWERS_FROM=TAG after rm -rf /tmp/ext)
  mkdir -p /tmp/gpu-logs && rm -f /tmp/gpu-logs/regen-logs-"$tag".tar.xz.part*
  # (with SELF_COUNT, the prompts the target wrote too: a later data call with the same tag asks for none)
  keep=(); for f in answers.jsonl regenerated.jsonl self-prompts.jsonl.xz self-prompts.json; do
    [ -f "/tmp/ext/regen/$f" ] && keep+=("$f"); done
  [ ${#keep[@]} -gt 0 ] && tar -C /tmp/ext/regen -cf - "${keep[@]}" | xz -T0 -3 \
    | split -b 15M - "/tmp/gpu-logs/regen-logs-$tag.tar.xz.part" && cp /tmp/gpu-logs/regen-logs-"$tag".tar.xz.part* "$OUT/" \
    || true
  save_kernels  # (after the answers: they matter more, should the call's time run out)
  [ "${PROFILE:-0}" != 1 ] || python3 -c "
import json, sys
from collections import Counter
from eaglenest.testing import sglang_profiler as p
empty = {'inclusive': Counter(), 'self': Counter(), 'samples': Counter()}
json.dump({r: p.summarize(empty, p.snapshot('$R/prof', r), top=30) for r in ('sched', 'http', 'client', 'validate', 'check')},
          sys.stdout, indent=1)
" > "$R/profile.json" || true
  [ "${PROFILE:-0}" != 1 ] || python3 scripts/profile_gaps.py --dmon "$R/dmon.txt" --prof "$R/prof" > "$R/gaps.json" || true
  # CAPTURE_CALIB=separate (or no extraction): the calibration capture on a server of its own, beside the conversions
  calib=; rm -f "$W/calib.log"; [ "$calib_mode" != separate ] || run python3 -c "
from eaglenest.speculative.calibration import CaptureSettings, capture_answers
s = CaptureSettings(model='$MODEL', engine='sglang', max_new_tokens=256, batch_size=512, concurrency=256,
                    sglang_args=['--attention-backend', 'triton', '--sampling-backend', 'pytorch',
                                 '--mem-fraction-static', '0.3'])
folder, rep = capture_answers('/tmp/gpu/calib-first.jsonl', s, '/tmp/calib')
print({k: rep.get(k) for k in ('samples', 'done', 'skipped')})" > "$W/calib.log" 2>&1 &
  [ "$calib_mode" != separate ] || calib=$!
  if [ "$STORE" = bf16 ]; then run python3 -m eaglenest store convert /tmp/ext/regen /tmp/store-bf16 --partial; fi
  if [ "$STORE" = fp8 ] || [ "${FP8:-0}" = 1 ]; then
    run python3 -m eaglenest store convert /tmp/ext/regen /tmp/store-fp8 --partial --encoding fp8 --device cuda
  fi
  if [ -n "$calib" ]; then  # (a call without one reports none: an earlier call's capture is not this call's)
    wait "$calib" || echo "calibration capture failed: $(tail -5 "$W/calib.log")" >&2
    tail -3 "$W/calib.log"; cp "$W/calib.log" "$R/"
  fi
  if [ "$calib_mode" != none ] && [ /tmp/calib/calibration/report.json -nt "$W/data-call.start" ]; then  # this call's
    cp /tmp/calib/calibration/report.json "$R/calibration-capture.json"
    # the target's answers to the eval prompts (about 1 MB): another engine can capture exactly these token
    # sequences (carried into a fresh extraction folder they are replayed, not generated) to compare features
    (cd /tmp/calib/calibration && tar -cJf "$R/calib-answers.tar.xz" answers.jsonl regenerated.jsonl) || true
  elif [ "$calib_mode" = inline ] && grep -q '"complete": true' /tmp/calib/calibration/report.json 2>/dev/null; then
    echo "the eval capture of an earlier data call of this window stands (/tmp/calib/calibration, complete)" >&2
  elif [ "$calib_mode" = inline ]; then  # (no fallback here: a separate capture would not fit the call's limit)
    echo "no eval capture in this call (extraction.json run.eval_capture: an error, or nothing was left to extract);" \
      "the offline side needs CAPTURE_CALIB=separate in a data call with time for it" >&2
  fi
  du -sb /tmp/ext/regen /tmp/store-bf16 /tmp/store-fp8 2>/dev/null | tee "$R/sizes.txt" || true  # no fp8 store: not an error
  for v in bf16 fp8; do python3 -m eaglenest store info "/tmp/store-$v" > "$R/store-$v.txt" 2>&1 || true; done
  ;;
prompts)
  # the target writes user prompts itself (`eaglenest prompts self` on a plain SGLang server: no capture), SELF_COUNT
  # of them, to /tmp/gpu-logs/self.jsonl.xz (SOURCE=self.jsonl.xz for data; `cat` it after another .jsonl.xz to mix
  # them) and to $OUT; evaluation prompts are left out by .gpu/eval-user-texts.json (the sets' packages are not here)
  # STARTER_SET (kinds): openings that spread the prompts over writing, roleplay, reasoning, math, coding,
  # extraction, STEM and humanities (left free, SmolLM2 writes mostly advice); several sets, space-separated, are
  # taken in turn together ("kinds code": 60 openings, 18 of them code); STARTER_SET= leaves them free
  ensure_model
  mkdir -p /tmp/gpu-logs
  starters=(); for set in ${STARTER_SET-kinds}; do starters+=(--starter-set "$set"); done
  # SELF_SEED (0): another base seed asks for other prompts (their ids, self-SEED-i, do not meet an earlier pack's)
  run python3 -m eaglenest prompts self --engine sglang --model "$MODEL" --count "${SELF_COUNT:-20000}" --seed "${SELF_SEED:-0}" \
    --concurrency 1024 --out /tmp/gpu-logs/self.jsonl.xz --exclude-file .gpu/eval-user-texts.json "${SGL[@]}" \
    ${starters[@]+"${starters[@]}"} \
    --sglang-arg=--mem-fraction-static --sglang-arg=0.5 > "$R/self-prompts.json"
  cat "$R/self-prompts.json"; cp /tmp/gpu-logs/self.jsonl.xz "$OUT/"
  ;;
train)
  grid=${GRID:-$W/grid.json}
  # the measured best recipe: TTT 4, lr 2e-3, draft vocab 16000, the draft MLP 4x the target's (at equal tokens 0.10
  # above the target's width on held-out @3, trained as fast: results/2026-12-02b-h200)
  # INIT_FROM (an exported drafter folder carried with the call, e.g. .gpu-drafters/cont): continue from it (its
  # vocabulary and MLP width are kept); 15.3M + 33.9M tokens this way gave the best drafter so far (2026-12-02c)
  # INIT_FROM=parts:NAME: the drafter NAME from its parts (a 63-MB export does not fit one 64-MiB call beside the
  # working tree: carry .gpu-drafters/parts-NAME/drafter-NAME.tar.part* split over a setup call and this one)
  copy_parts
  init_dir=; [ -z "${INIT_FROM:-}" ] || init_dir=$(init_drafter "$INIT_FROM")
  init=; [ -z "$init_dir" ] || init=", \"init_from\": \"$init_dir\""
  # DRAFTER_NAME names the default grid's one config, rewritten by every train call (a warm machine keeps /tmp: an
  # earlier call's grid would train under its name and from its INIT_FROM); a name is also a folder and a file name
  name=${DRAFTER_NAME:-wide}
  case "$name" in ''|*[!A-Za-z0-9._-]*) echo "DRAFTER_NAME must be letters, digits, '.', '_' or '-', got '$name'" >&2
                                       exit 2 ;; esac
  [ -n "${GRID:-}" ] || echo "{\"$name\": {\"draft_vocab_size\": 16000, \"ttt_steps\": 4, \"lr\": 0.002, \"draft_intermediate_size\": 6144$init}}" > "$grid"
  # KL_KERNEL (auto): the draft-vocab KL in Triton kernels (eaglenest/drafter/kl_loss.py: one pass over the logits
  # each way instead of the fp32 log-softmax's several) or the PyTorch ops. Unless torch, the kernels are first
  # checked against the ops on this GPU (~10 s; a failed check trains with the ops). KL_AB=1 then times one training
  # step of the grid's shape with each, alternating (90 s at most with the check, outside TRAIN_MINUTES), and auto
  # takes the faster; without it auto takes the kernels once checked (2026-12-05d, H100: 0.108 s a step against
  # 0.169 s, 155.6K tok/s in training against 122.2K)
  kernel=${KL_KERNEL:-auto}
  case "$kernel" in auto|torch|triton) ;; *) echo "KL_KERNEL must be auto, torch or triton, got '$kernel'" >&2; exit 2 ;; esac
  kl_ok=0; faster=
  if [ "$kernel" != torch ]; then
    kl_end=$(( $(date +%s) + 90 ))
    if run timeout 40 python3 -c "
import json, sys
from eaglenest.testing.kl_kernels import check_kernels
r = check_kernels('cuda')
print(json.dumps(r))
sys.exit(0 if r['ok'] else 1)" > "$R/kl-check.txt" 2>&1; then kl_ok=1; fi
    if [ "${KL_AB:-0}" = 1 ]; then
      vocab=$(python3 scripts/gpu_sweep.py --planned-vocab --grid "$grid" --target "$MODEL")  # its first config's
      for kern in torch triton torch triton; do
        left=$(( kl_end - $(date +%s) )); [ "$left" -gt 5 ] || break
        run env EAGLENEST_KL_KERNEL=$kern timeout "$left" python3 scripts/bench_train.py step --device cuda \
          --model "$MODEL" --tokens 32768 --seq 512 --vocab "$vocab" --k 4 --loss-share 0.68 --precision bf16 \
          --repeat 6 >> "$R/kl-kernels.txt" 2>&1 || true
      done
      faster=$(python3 -c "
import json, sys
best = {}
for line in open(sys.argv[1]):
    if line.startswith('{') and '\"kl_kernel\"' in line:
        r = json.loads(line)
        best[r['kl_kernel']] = min(best.get(r['kl_kernel'], 1e9), r['step_s'])
print('triton' if best.get('triton', 1e9) < best.get('torch', 0) else 'torch', best)" "$R/kl-kernels.txt" || echo torch)
      echo "KL kernels: best step_s: $faster" | tee -a "$R/kl-kernels.txt" >&2
    fi
    [ "$kl_ok" = 1 ] || { echo "the Triton KL kernels failed their check on this GPU ($R/kl-check.txt): the ops" >&2
                           kernel=torch; }
    if [ "$kernel" = auto ]; then kernel=triton; [ -z "$faster" ] || kernel=${faster%% *}; fi
  fi
  echo "training with the KL in $kernel" >&2
  export EAGLENEST_KL_KERNEL=$kernel
  # epochs (in tenths) that end within 85% of the time budget at TRAIN_TOK_S per config, so the step schedule finishes
  # and the budget stays a safety stop. Measured per config: 80.4-80.7K tok/s two at once on first-turn samples
  # (2026-12-02b), 82.4K alone on 8-turn samples; 44-49K two at once on longer samples (2026-12-01); 108.4K at 32K
  # tokens per step (vocab 16000) beside 73.5K at 16K (vocab 32000), two at once (2026-12-02e): size for the slower;
  # 143.6K alone at gpu_sweep's 32K tokens a step (vocab 32000, 2026-12-04)
  # TRAIN_TOK_S by card and kernel when not given, one config alone: the ops 116.9-122.2K tok/s on the H100 (n5, n6),
  # 143.6K on the H200 (n2); the Triton kernels 155.6K on the H100 (n7; sized for the ops, its schedule ended after
  # 207 s of 312), 192K (n9) and 222K (n12, 32K-token steps on 10.2M tokens; sized for 150K, it ended after 312 s
  # of 450), and 189.2K and 177K on the H200 (n8, n11): a little under what was measured (165K on the H100: n7's
  # 155.6K then fills 90% of TRAIN_MINUTES before ~45 s of evals and start), since a schedule that does not finish
  # in TRAIN_MINUTES is cut before its learning rate has decayed
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true)
  case "$card/$kernel" in
    *H100*/triton) tok_s=${TRAIN_TOK_S:-165000} ;; *H100*) tok_s=${TRAIN_TOK_S:-115000} ;;
    */triton) tok_s=${TRAIN_TOK_S:-180000} ;; *) tok_s=${TRAIN_TOK_S:-140000} ;;
  esac
  epochs=${EPOCHS:-$(python3 -c "
import math
from eaglenest.drafter.config import TrainConfig
from eaglenest.store.extraction import open_samples
held = TrainConfig.model_fields['eval_fraction'].default  # the held-out split is not trained on
tokens = int(open_samples('$TRAIN_DATA', check_sha256=False).num_tokens.sum()) * (1 - held)
print(max(0.5, math.floor(10 * ${TRAIN_MINUTES:-8.5} * 60 * 0.85 * $tok_s / tokens) / 10))")}
  echo "training $epochs epochs ($tok_s tok/s assumed)" >&2
  # PROFILE=1: where a training step's GPU time goes (random data of the target's shape, one profiled step, at
  # gpu_sweep's tokens a step; 0.68 of the tokens under the loss, as in the 2026-12-04 extraction). That day's
  # trainer waited 61 ms a step for the device after 145 ms of its own host work: on real rows the device, not the
  # host, set the pace at 32K tokens (0.206 s a step against bench_train's 0.145 s on 512-token rows). The profile
  # of 2026-12-04b (results/2026-12-04b-h200/train-step-profile.txt, TTT 7, bench_train's default then): 0.248 s a
  # step on 512-token rows, 0.355 s on 2,048-token rows (the attention's T x T scores grow with the row); on 512-token
  # rows elementwise mul and copies took ~38% of the GPU time, log-softmaxes ~16%, mm + bmm 26%: memory traffic of
  # the fp32 draft-vocab loss ([TTT x ~22K rows x 32000] values), more than the matmuls
  [ "${PROFILE:-0}" != 1 ] || run timeout 150 python3 scripts/bench_train.py step --device cuda --model "$MODEL" \
    --tokens 32768 --seq 512 2048 --vocab 32000 --k 4 --loss-share 0.68 --precision bf16 --profile 40 \
    > "$R/train-profile.txt" 2>&1 || true
  evals=()
  [ -f /tmp/calib/calibration/ledger.jsonl ] && for s in mt-bench humaneval sharegpt; do
    evals+=(--eval-set "$s=/tmp/calib/calibration"); done
  cp "$grid" "$W/trained-grid.json"  # (what a later bench serves when DRAFTERS is not given)
  run env OUT="$R" python3 scripts/gpu_sweep.py --store "$TRAIN_DATA" --target "$MODEL" --grid "$grid" \
    "${evals[@]}" --epochs "$epochs" --eval-every 200 --max-minutes "${TRAIN_MINUTES:-8.5}" --work /tmp/sweep
  for d in /tmp/sweep/*/; do cp "$d/result.json" "$R/result-$(basename "$d").json" 2>/dev/null || true; done
  for name in $(grid_names "$grid"); do
    run python3 -m eaglenest export "/tmp/sweep/$name" "/tmp/export/$name" --target "$MODEL"
    # AVERAGE=1 (with INIT_FROM): also NAME-avg, the mean of the continued drafter's weights and those it started
    # from (`eaglenest average`: n9 + n10 beat both offline, results/2026-12-05g-cpu); bench DRAFTERS="NAME NAME-avg";
    # the continued drafter first: a widened one holds the vocabulary it started from, not the other way round
    if [ "${AVERAGE:-0}" = 1 ] && [ -n "$init_dir" ]; then
      run python3 -m eaglenest average "/tmp/export/$name" "$init_dir" --out "/tmp/export/$name-avg" --overwrite \
        || echo "average $name exited $?" >&2
    fi
    # TRIM=N: also NAME-tN, the draft head cut to the N tokens most frequent in the training data (`eaglenest
    # trim-vocab`): in SGLang's draft phase the head's GEMM, the softmax and the top-k over the draft vocabulary took
    # ~0.36 ms of the 1.0 ms a 7x8x48 tree's draft steps cost a cycle (n14, 32,000 tokens; profile-n14-7x8x48.json of
    # 2026-12-06g); bench DRAFTERS="NAME NAME-tN" with the tree's flags and ROUNDS to gate both
    if [ -n "${TRIM:-}" ]; then trim_export "$name" "$TRIM" || echo "trim $name exited $?" >&2; fi
  done
  # the drafters come back (parts of <= 15 MB) for the CPU benchmark: as many as fit this call's 8 files beside
  # train.tgz; the rest come back with the bench call (listed in $W/drafters-left.txt)
  : > "$W/drafters-left.txt"
  for name in $(grid_names "$grid"); do
    send_back "$name" 7 || echo "$name" >> "$W/drafters-left.txt"
  done
  ;;
bench)
  if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then  # (refused before anything runs)
    [ "${ROUNDS:-1}" -gt 1 ] || { echo "SIDE_BY_SIDE=1 measures in shared rounds: ROUNDS=2 or more" >&2; exit 2; }
    [ "${CALIB:-0}" = 0 ] || { echo "SIDE_BY_SIDE=1 with CALIB=1: calibrate one drafter at a time" >&2; exit 2; }
  fi
  # first the drafters the train call had no room to bring back (a bench cut short by its timeout still returns them)
  if [ -f "$W/drafters-left.txt" ]; then  # (a later bench call returns only what is still left)
    left=$(cat "$W/drafters-left.txt"); : > "$W/drafters-left.txt"
    for name in $left; do
      send_back "$name" 7 || { echo "drafter $name does not fit this call's files either" >&2
                               echo "$name" >> "$W/drafters-left.txt"; }
    done
  fi
  # a bench before any data call (e.g. an earlier window's drafter served first): the model from gguf2 carried with
  # this call, the prompt sets from .gpu
  serve_inputs
  machine_state "$R/machine-bench.txt"  # before the servers: leftovers of earlier calls, clocks, the host's CPU
  host_samples "$R/host-samples.txt" & SAMPLER=$!  # (finish stops it: it must not outlive the call)
  first=1  # the first drafter is measured on every prompt set, the others on MT-Bench only
  drafters=${DRAFTERS:-wide}  # (unset: the last train call's drafters)
  [ -n "${DRAFTERS:-}" ] || [ ! -f "$W/trained-grid.json" ] || drafters=$(grid_names "$W/trained-grid.json")
  if [ "$drafters" = best ]; then  # the train step's drafters, the highest offline MT-Bench accept length @3 first
    drafters=$(python3 -c "
import glob, json, os
def score(path):
    ev = json.load(open(path)).get('eval_sets', {}).get('mt-bench', {})
    return (ev.get('accept_length_cycles') or {}).get('3', 0.0)
runs = sorted(glob.glob('/tmp/sweep/*/result.json'), key=score, reverse=True)
print(' '.join(os.path.basename(os.path.dirname(r)) for r in runs) or 'none')")
    echo "drafters, best by offline MT-Bench @3 first: $drafters" >&2
  fi
  # SIDE_BY_SIDE=1 (with ROUNDS > 1): every drafter in ONE grid, their EAGLE3 servers up together with the baseline
  # in the same alternating rounds (matrix.json's side_by_side: each one's tok/s over the first's, round by round);
  # VERIFY_KERNEL=sglang,splitkv compares the kernels so (one server per drafter and kernel). Between two calls the
  # same server moved 4.02 -> 3.70 ms a cycle (2026-12-07e): a difference under ~8% needs the shared rounds
  # (on MT-Bench unless SETS=all: every set on every server would be N times a bench's work in one call)
  side=""
  if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
    for name in $drafters; do
      [ "$name" != none ] || continue
      resolve_draft "$name"; side+="${side:+,}$draft"
    done
    [ -n "$side" ] || { echo "SIDE_BY_SIDE=1: no drafters ($drafters)" >&2; exit 2; }
    drafters=side-by-side; SETS=${SETS:-mt-bench}
  fi
  for name in $drafters; do
    [ "$name" != none ] || continue
    sets=/tmp/gpu/mt-bench.jsonl,/tmp/gpu/humaneval.jsonl,/tmp/gpu/sharegpt.jsonl
    case "${SETS:-all}" in all|mt-bench) ;; *) echo "SETS must be all or mt-bench, got '$SETS'" >&2; exit 2 ;; esac
    [ "$first" = 1 ] && [ "${SETS:-all}" = all ] || sets=/tmp/gpu/mt-bench.jsonl
    first=0
    if [ -n "$side" ]; then draft=$side; else resolve_draft "$name"; fi
    # SGL_EXTRA reaches both servers here too (e.g. "--enable-torch-compile --torch-compile-max-bs 1"; the grid sets
    # the attention and sampling backends itself); a baseline is reused only by a bench with the same flags, those
    # of speculation (--speculative-*, e.g. "--speculative-attention-mode decode") aside: the baseline runs none
    # (SGLANG_* environment variables reach the servers as they are)
    base=()
    if [ -f "$W/server_baseline.json" ] && [ "$(cat "$W/server_baseline.args" 2>/dev/null)" = "$(baseline_flags)" ]; then
      base=(--baseline-json "$W/server_baseline.json")
    fi
    # ROUNDS > 1: baseline and EAGLE3 up together, each level in alternating rounds (no reused baseline)
    [ "${ROUNDS:-1}" = 1 ] || base=(--rounds "$ROUNDS")
    # each grid in a folder of its own (steps, topk, time): a later tree on the same drafter no longer writes over
    # the steps-3 matrix, and only a baseline this very grid measured alone becomes the one later benches reuse
    # (2026-12-06c: a rounds grid's one-level baseline, left in a shared folder, was cached after the next grid)
    # SHAPES=6x8x49,7x8x48 (with ROUNDS > 1): one EAGLE3 server per tree, side by side, in place of STEPS/TOPK/
    # DRAFT_TOKENS
    shape=(--steps "${STEPS:-3}" --topk "${TOPK:-1}" ${DRAFT_TOKENS:+--draft-tokens "$DRAFT_TOKENS"})
    tag=steps${STEPS:-3}-topk${TOPK:-1}${DRAFT_TOKENS:+-dt$DRAFT_TOKENS}
    if [ -n "${SHAPES:-}" ]; then shape=(--shapes "$SHAPES"); tag=shapes-${SHAPES//,/+}; fi
    g="$R/grid-$name/$tag${VERIFY_KERNEL:+-${VERIFY_KERNEL//,/+}}-$(date -u +%H%M%S)"
    mkdir -p "$g"
    run env OUT="$g" python3 scripts/gpu_bench_grid.py --model "$MODEL" --draft "$draft" \
      --prompts "$sets" --num-prompts "$NUM_PROMPTS" --concurrency "${LEVELS:-1,16}" "${shape[@]}" \
      --max-new-tokens 256 "${base[@]}" "${SGL_MORE[@]}" \
      "${BASE_MORE[@]}" --verify-kernel "${VERIFY_KERNEL:-sglang}" \
      || echo "grid $name exited $?" >&2
    # (a baseline measured beside EAGLE3, at a share of the GPU's memory, is not reused; $g holds a baseline only
    # when this grid measured one: none when it reused the cached one, which it does only if that covers its prompt
    # sets and levels). A narrower one (a tree's LEVELS=1 SETS=mt-bench) does not replace a cached wider one of the
    # same flags: the next full bench would measure again (~150 s)
    if [ "${ROUNDS:-1}" = 1 ] && [ -f "$g/server_baseline.json" ]; then
      if [ ! -f "$W/server_baseline.json" ] || [ "$(cat "$W/server_baseline.args" 2>/dev/null)" != "$(baseline_flags)" ] \
         || baseline_covers "$g/server_baseline.json" "$W/server_baseline.json"; then
        cp -p "$g/server_baseline.json" "$W/" && baseline_flags > "$W/server_baseline.args"
      else echo "kept the cached baseline: this grid's ($g) holds fewer prompt sets or levels" >&2; fi
    fi
    # the offline side is already in the train step's eval curves (the same calibration capture); CALIB=1
    # also scores the exported drafter (a check of the export) when the call has time left
    if [ "${CALIB:-0}" = 1 ]; then
      mkdir -p "$R/calib-$name"
      run env OUT="$R/calib-$name" python3 scripts/gpu_calibrate.py --model "$MODEL" --draft "$draft" \
        --prompts /tmp/gpu/calib-first.jsonl --work /tmp/calib --live "$g/matrix.json" \
        || echo "calibration $name exited $?" >&2
    fi
  done
  stop_sampler
  # the kernel caches of these launches too (a data call cut short never reached its own save): keep the file
  # in .gpu-logs for the next session's first launch (85 s of compiling on a fresh machine, 9 s warm)
  save_kernels
  ;;
profile)
  # where a baseline decode step and a speculation cycle spend their time: SGLang's torch profiler (CPU + GPU) over
  # REQUESTS (2) greedy MT-Bench requests at concurrency 1 on each server, DRAFTERS' first drafter at STEPS, TOPK,
  # DRAFT_TOKENS; profile.json sums each trace (the GPU's busy share, idle gaps, top kernels, host CUDA calls)
  case "${DRAFTERS:-}" in ''|best|' '*) echo "profile needs DRAFTERS=NAME, a folder or parts:NAME (one drafter), got \
'${DRAFTERS:-}'" >&2; exit 2 ;; esac
  serve_inputs
  resolve_draft "${DRAFTERS%% *}"
  # (VERIFY_KERNEL=splitkv: the EAGLE3 server with eaglenest's verify kernel; ONLY=eagle3: that server alone)
  run env OUT="$R/profile-$name${VERIFY_KERNEL:+-$VERIFY_KERNEL}" python3 scripts/gpu_profile_cycle.py --model "$MODEL" --draft "$draft" \
    --prompts /tmp/gpu/mt-bench.jsonl --steps "${STEPS:-3}" --topk "${TOPK:-1}" \
    ${DRAFT_TOKENS:+--draft-tokens "$DRAFT_TOKENS"} --requests "${REQUESTS:-2}" "${SGL_MORE[@]}" "${BASE_MORE[@]}" \
    --verify-kernel "${VERIFY_KERNEL:-sglang}" ${ONLY:+--only "$ONLY"} || echo "profile $name exited $?" >&2
  save_kernels  # (its two launches compile as a bench's do)
  ;;
kernel)
  # eaglenest's split-KV tree-verify kernel against SGLang's own, alone (the kit only: after the first setup call,
  # ~1 minute with Triton's compiling): correctness against float64 attention and microseconds per call in CUDA
  # graphs at the served target's heads, 48 draft tokens, prefixes 100-1000, batch 1 and 16 (verify-kernel.json)
  run env OUT="$R" python3 scripts/gpu_verify_kernel.py ${KERNEL_ARGS:-} || echo "kernel check exited $?" >&2
  ;;
specforge)
  # SpecForge 0.2.0 and the two wheels the kit lacks (.device/specforge, 1.1 MB, from `pip download specforge
  # datasets multiprocess --no-deps`) next to the kit; both trainers on the same first samples of the store
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sfsite .device/specforge/*.whl
  export PYTHONPATH="/tmp/site:/tmp/sfsite:$PWD"
  python3 -c "import specforge.algorithms.eagle3.model"
  rm -rf /tmp/store-fp8  # the converted features: 4.6 KB a token (7 GB for 1.5M)
  # SF_WORK: where they go; /dev/shm (RAM) when the extraction read in place (STORE=extraction) fills the disk
  sf=(--store "$TRAIN_DATA" --target "$MODEL" --work "${SF_WORK:-/tmp/sf}" --max-train-tokens "${SF_TOKENS:-1500000}"
      --epochs "${SF_EPOCHS:-2}" --draft-vocab 16000)
  evals=(--eval-set mt-bench=/tmp/calib/calibration --eval-set humaneval=/tmp/calib/calibration
         --eval-set sharegpt=/tmp/calib/calibration)
  run timeout 150 python3 scripts/gpu_specforge.py convert "${sf[@]}"
  run timeout 330 env OUT="$R" python3 scripts/gpu_specforge.py train-specforge "${sf[@]}" 2>&1 | grep -v '^step '
  run timeout 180 env OUT="$R" python3 scripts/gpu_specforge.py train-eaglenest "${sf[@]}" --check-sha256 0
  run timeout 90 env OUT="$R" python3 scripts/gpu_specforge.py score "${sf[@]}" --check-sha256 0 "${evals[@]}"
  ;;
*) echo "unknown step $STEP" >&2; exit 2 ;;
esac
