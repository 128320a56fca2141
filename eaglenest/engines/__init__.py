"""Engines that capture hidden states: the embedded CPU server, SGLang with the capture plugin.

The test instruments in :mod:`eaglenest.testing` (fault injection, the draft-input probe, the sampling
profiler) are switched on only by these environment variables; production code reads the variable and
imports the instrument lazily when it is set, so a production process never loads one.
"""

ENV_FAULTS = "EAGLENEST_FAULTS"
ENV_PROBE_DRAFT_DIR = "EAGLENEST_PROBE_DRAFT_DIR"
ENV_PROFILE_DIR = "EAGLENEST_SAMPLE_PROFILE"
ENV_PROFILE_INTERVAL = "EAGLENEST_SAMPLE_INTERVAL_S"
