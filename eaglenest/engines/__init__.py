"""Engines that capture hidden states: the embedded CPU server, SGLang with the capture plugin."""
