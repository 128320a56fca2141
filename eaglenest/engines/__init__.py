"""Engines that capture hidden states: the embedded CPU server, SGLang with the capture plugin.

The test instruments in :mod:`eaglenest.testing` (fault injection, the draft-input probe, the sampling
profiler) are switched on only by these environment variables; production code reads the variable and
imports the instrument lazily when it is set, so a production process never loads one.
"""

from pathlib import Path
from typing import Literal, get_args

ENV_FAULTS = "EAGLENEST_FAULTS"
ENV_PROBE_DRAFT_DIR = "EAGLENEST_PROBE_DRAFT_DIR"
ENV_PROFILE_DIR = "EAGLENEST_SAMPLE_PROFILE"
ENV_PROFILE_INTERVAL = "EAGLENEST_SAMPLE_INTERVAL_S"
ENV_VERIFY_KERNEL = "EAGLENEST_VERIFY_KERNEL"  # an EAGLE3 server's tree-verify attention (sglang_tree_verify)
VerifyKernel = Literal["sglang", "splitkv"]  # SGLang's own; eaglenest's split-KV tree kernel (triton backend)
VERIFY_KERNELS: tuple[str, ...] = get_args(VerifyKernel)
VERIFY_KERNEL_CALLED = "eaglenest verify kernel: first tree verify"  # logged once per server process


def verify_kernel_seen(log_path: Path) -> str | None:
    """What a server's log says of eaglenest's verify kernel's first call (batch, draft tokens, heads, splits,
    mask), or None where it never ran: the proof that numbers measured with ``splitkv`` are the kernel's."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    line = next((x for x in text.splitlines() if VERIFY_KERNEL_CALLED in x), None)
    return line.split("eaglenest verify kernel: ", 1)[1] if line else None
