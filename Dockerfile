# tim-enhancer service image.
#   CPU (default):  docker build -t tim-enhancer .
#   CUDA:           docker build -t tim-enhancer:gpu --build-arg DEVICE=gpu .
#   run:            docker run --rm -p 8000:8000 tim-enhancer            (add --gpus all for the CUDA image)
# The image holds the inference runtime and the service only (no torch), plus the shipped model; the
# test and benchmark harness (tools/, training/peers/) stays out (.dockerignore, and the package
# does not declare it).
ARG DEVICE=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base-cpu

# The CUDA image needs no CUDA base: the [gpu] extra installs onnxruntime-gpu with the CUDA 13 and cuDNN
# libraries it was built against, from their Python wheels (pinned in pyproject.toml; the runtime loads
# them from there), and the NVIDIA container toolkit mounts the host's driver (`--gpus all`).
FROM ${PYTHON_IMAGE} AS base-gpu
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# hadolint ignore=DL3006
FROM base-${DEVICE}
ARG DEVICE
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    TIM_ENHANCER_MODEL=/app/models/tim.onnx

WORKDIR /app
COPY pyproject.toml README.md* LICENSE ./
COPY enhancer ./enhancer
COPY server ./server
# the package installs the shipped model (models/ -> enhancer/models/) and declares training/ (no torch is installed)
COPY models ./models
COPY training ./training
# onnxruntime (DEVICE=cpu) or onnxruntime-gpu (DEVICE=gpu): pyproject's extras pin every version
# hadolint ignore=DL3013
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir "numpy==2.4.6" \
    && pip install --no-cache-dir ".[${DEVICE},serve]" \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin enhancer

USER 10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]
CMD ["enhancer", "serve", "--host", "0.0.0.0", "--port", "8000"]
