"""Speculative decoding with an EAGLE-3 drafter: the embedded decoder and the benchmarks that gate a drafter.

Modules (imports point downwards: engines, drafter -> draft, kernels -> onednn -> fastpath -> target, kernels ->
quant -> tree -> drafting -> decoder -> serve -> live -> report -> bench; loadgen -> live, report):

- :mod:`~eaglenest.speculative.draft`      an exported SGLang-format drafter folder as an
  :class:`eaglenest.drafter.model.Eagle3Drafter` (target's embedding), compatibility checks.
- :mod:`~eaglenest.speculative.kernels`    the skinny bf16 linear (``skinny.cpp``): few-row decode matmuls that
  stream the weights like a 1-row GEMV, built once per machine.
- :mod:`~eaglenest.speculative.quant`      the drafter's linear weights in int8 (q8) or int4 (q4): quantize,
  dequantize, the kernels' product.
- :mod:`~eaglenest.speculative.onednn`     oneDNN per decoding phase, prepacked linear weights.
- :mod:`~eaglenest.speculative.fastpath`   transformers' target at decode time: fused projections, grouped-query
  attention without K/V copies.
- :mod:`~eaglenest.speculative.target`     the decode-time target of both decoders: a lean Llama forward with a
  preallocated KV cache, else transformers' prepared forward.
- :mod:`~eaglenest.speculative.tree`       speculation shapes (chain, EAGLE-2 tree), tree verify mask, path
  acceptance, the measured default shape per kind of CPU (``cpu_shape.json``).
- :mod:`~eaglenest.speculative.drafting`   the drafter at decode time (fused weights, preallocated KV, chain
  and tree proposals).
- :mod:`~eaglenest.speculative.decoder`    lossless greedy speculation (chain or tree) over a transformers
  target (:class:`SpecDecoder`, :func:`plain_greedy`, :class:`AcceptStats`).
- :mod:`~eaglenest.speculative.cpu_bench`  side-by-side CPU benchmark (speculative vs plain, one process).
- :mod:`~eaglenest.speculative.offline`    teacher-forced accept length from a store, and calibration.
- :mod:`~eaglenest.speculative.serve`      the embedded server as a benchmark target (SGLang's flags and
  meta_info), :class:`SpecConfig`.
- :mod:`~eaglenest.speculative.loadgen`    load generator (httpx, fixed concurrency; levels, alternating rounds).
- :mod:`~eaglenest.speculative.live`       the benchmarked servers (launch, warmup, stop), SGLang command line.
- :mod:`~eaglenest.speculative.prompts`    prompt sets shipped in PyPI packages (MT-bench, HumanEval, ShareGPT).
- :mod:`~eaglenest.speculative.report`     report files, plots and the deployment gate.
- :mod:`~eaglenest.speculative.bench`      :class:`BenchConfig` (the flow's parameters) and the steps.

Conventions: accept length always counts the bonus token (tokens per target verify forward);
SGLang's ``--speculative-num-draft-tokens`` counts the root token (chain: ``num_steps + 1``).
"""
