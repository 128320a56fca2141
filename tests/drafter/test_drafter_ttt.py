"""TTT objective: the unrolled training forward is the SGLang chain draft, and its metrics are right."""

from __future__ import annotations

import torch
from test_drafter_model import tiny_drafter

from eaglenest.drafter.model import DraftKVCache
from eaglenest.drafter.ttt import (
    Batch,
    TargetRows,
    TTTResult,
    accept_lengths,
    step_counts,
    target_rows,
    ttt_forward,
    unroll,
)


def make_batch(model, lengths, seed=0) -> Batch:
    torch.manual_seed(seed)
    cfg = model.config
    b, t = len(lengths), max(lengths)
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    mask = torch.zeros(b, t, dtype=torch.bool)
    for r, n in enumerate(lengths):
        mask[r, 3:n] = True
    return Batch(ids, mask, torch.randn(b, t, cfg.num_aux * cfg.target_hidden_size), torch.randn(b, t, cfg.hidden_size),
                 torch.tensor(lengths), tuple(range(b)))


def test_unroll_equals_kv_cached_chain_at_every_anchor():
    model = tiny_drafter(seed=5).eval()
    batch = make_batch(model, [14, 9])  # right padding in row 1
    k = 4
    with torch.no_grad():
        steps = list(unroll(model, batch, k))
    for row, n in ((0, 14), (1, 9)):
        for anchor in range(n - k - 1):
            ids, aux = batch.input_ids[row : row + 1], batch.aux_hidden[row : row + 1]
            cache = DraftKVCache()
            with torch.no_grad():  # extend over positions 0..anchor: token x[p+1] with aux[p]
                out = model.extend(ids[:, 1 : anchor + 2], aux[:, : anchor + 1], torch.arange(anchor + 1)[None], cache)
                torch.testing.assert_close(out.hidden[0, -1], steps[0][row, anchor], rtol=1e-5, atol=1e-5)
                h = out.hidden[:, -1:]
                for i in range(1, k):  # teacher-forced chain step i: token x[anchor+1+i], position anchor+i
                    tok = ids[:, anchor + 1 + i : anchor + 2 + i]
                    out = model(tok, h, torch.tensor([[anchor + i]]), cache)
                    torch.testing.assert_close(out.hidden[0, -1], steps[i][row, anchor], rtol=1e-5, atol=1e-5)
                    h = out.hidden


def test_step_counts_and_target_rows():
    model = tiny_drafter(seed=1)
    batch = make_batch(model, [10, 6])
    # loss rows: row0 3..9 (7), row1 3..5 (3); step i counts rows j >= 1+i
    assert step_counts(batch.loss_mask, 4).tolist() == [10, 10, 10, 8]
    head = torch.randn(model.config.vocab_size, model.config.hidden_size)
    draft_ids = model.to_target_ids(torch.arange(model.config.draft_vocab_size))
    rows = target_rows(batch, head, draft_ids, model.t2d)
    assert int((rows.row_of >= 0).sum()) == 10 and rows.p.shape == (10, model.config.draft_vocab_size)
    full = batch.final_hidden[batch.loss_mask] @ head.T
    assert torch.equal(rows.argmax, full.argmax(-1))
    torch.testing.assert_close(rows.p.sum(-1), torch.ones(10))
    logp = torch.log_softmax(full[:, draft_ids], -1)
    torch.testing.assert_close(rows.p, logp.exp())
    torch.testing.assert_close(rows.neg_entropy, (logp.exp() * logp).sum(-1))


def test_accept_length_counts_leading_matches_plus_bonus():
    # one row of 8 tokens, loss rows 1..7 -> anchors 0..6; matches per step chosen by hand
    row_of = torch.tensor([[-1, 0, 1, 2, 3, 4, 5, 6]])
    rows = TargetRows(row_of=row_of, p=torch.zeros(7, 2), neg_entropy=torch.zeros(7),
                      argmax=torch.zeros(7, dtype=torch.int64),
                      in_vocab=torch.ones(7, dtype=torch.bool))
    m = [[1, 1, 0, 1, 0, 0, 0, 0], [1, 0, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    res = TTTResult(loss_sum=torch.zeros(3), correct=torch.zeros(3, dtype=torch.int64),
                    kept=torch.zeros(3, dtype=torch.int64), counted=(0, 0, 0),
                    match=torch.tensor(m, dtype=torch.bool)[:, None])  # [k, B=1, T]
    total, n = accept_lengths(res, rows, 3)
    # anchor0: 3 matches -> 4; anchor1: step1 miss -> 2; anchor2: step0 miss -> 1; anchor3: 3 -> 4; rest 1
    assert n == 7 and total == 4 + 2 + 1 + 4 + 1 + 1 + 1
    assert accept_lengths(res, rows, 1) == (1 + 1 + 0 + 1 + 0 + 0 + 0 + 7, 7)


def test_step_loss_is_the_kl_to_the_target_on_counted_rows_with_gradient():
    model = tiny_drafter(seed=2)
    batch = make_batch(model, [12, 8])
    head = torch.randn(model.config.vocab_size, model.config.hidden_size)
    draft_ids = model.to_target_ids(torch.arange(model.config.draft_vocab_size))
    rows = target_rows(batch, head, draft_ids, model.t2d)
    assert 0 < int(rows.in_vocab.sum()) < rows.in_vocab.numel()  # some target argmaxes fall outside
    results = ttt_forward(model, batch, rows, 3)
    outs = list(unroll(model, batch, 3))
    full = batch.final_hidden @ head.T  # [B, T, V]
    for i, (res, out) in enumerate(zip(results, outs, strict=True)):
        want, n = torch.tensor(0.0), 0
        for b in range(2):
            for t in range(12):
                j = t + 1 + i
                if j >= 12 or not batch.loss_mask[b, j]:
                    continue
                n += 1
                logp = torch.log_softmax(full[b, j, draft_ids], -1)
                logq = torch.log_softmax(model.head(out[b, t]), -1)
                if model.t2d[full[b, j].argmax()]:
                    want = want + (logp.exp() * (logp - logq)).sum()
        assert res.counted == n
        torch.testing.assert_close(res.loss_sum, want, rtol=1e-4, atol=1e-5)
    sum(r.loss_sum for r in results).backward()
    assert model.fc.weight.grad is not None and model.embed_weight.grad is None


def test_batched_ttt_losses_accuracies_and_gradients_equal_the_kv_cached_chain():
    """ttt_forward scores all k steps in one block; every (anchor, step) pair scored on its own through the
    inference path (a KV-cached chain) gives the same losses, accuracies, matches and gradients (fp32)."""
    k, scales = 4, [0.8**i for i in range(4)]
    model = tiny_drafter(seed=3)
    batch = make_batch(model, [13, 9], seed=4)
    batch.loss_mask[0, 1:13] = True  # loss from column 1: pairs whose anchor falls before the sample
    head = torch.randn(model.config.vocab_size, model.config.hidden_size)
    draft_ids = model.to_target_ids(torch.arange(model.config.draft_vocab_size))
    rows = target_rows(batch, head, draft_ids, model.t2d)
    res = ttt_forward(model, batch, rows, k)
    sum(res.loss_sum[i] * s for i, s in enumerate(scales)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    b, t = batch.input_ids.shape
    loss, correct, counted = [torch.tensor(0.0)] * k, [0] * k, [0] * k
    match = torch.zeros(k, b, t, dtype=torch.bool)
    for row in range(b):
        ids, aux = batch.input_ids[row : row + 1], batch.aux_hidden[row : row + 1]
        for anchor in range(t - 1):
            cache = DraftKVCache()
            out = model.extend(ids[:, 1 : anchor + 2], aux[:, : anchor + 1], torch.arange(anchor + 1)[None], cache)
            for i in range(k):
                j = anchor + 1 + i
                if j >= t:
                    break
                if i > 0:  # teacher-forced chain step i: token x[anchor+1+i] at position anchor+i
                    out = model(ids[:, j : j + 1], out.hidden[:, -1:], torch.tensor([[anchor + i]]), cache)
                r = int(rows.row_of[row, j])
                if r < 0:
                    continue
                logits = out.logits[0, -1]
                kl = rows.neg_entropy[r] - (rows.p[r] * torch.log_softmax(logits, -1)).sum()
                loss[i] = loss[i] + kl * rows.in_vocab[r]
                hit = bool(model.to_target_ids(logits.argmax()) == rows.argmax[r])
                correct[i] += hit
                counted[i] += 1
                match[i, row, anchor] = hit
    sum(x * s for x, s in zip(loss, scales, strict=True)).backward()
    assert res.counted == tuple(counted) == tuple(step_counts(batch.loss_mask, k).long().tolist())
    assert counted[1] < counted[0]  # the uncounted pairs are exercised
    assert res.correct.tolist() == correct and torch.equal(res.match, match)
    torch.testing.assert_close(res.loss_sum, torch.stack(loss).detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():  # fp32 sums in another order: an error small against the gradient's scale
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6 * scale, msg=lambda m, n=n: f"{n}: {m}")
