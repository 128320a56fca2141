"""Test instruments: fault injection, fake extractions, the SGLang draft-input probe, the sampling profiler, the
check of the KL kernels and the tiny model. Production code never imports these at module level; it switches one
on only through an explicit opt-in (the environment variables in :mod:`eaglenest.engines`, or a command such as
``eaglenest model tiny``) and imports it lazily then.
"""
