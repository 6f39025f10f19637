# syntax=docker/dockerfile:1
#
# One image for every gpuwarden process: the five services (`gpuwarden service <name>`), the simulated cluster
# (`gpuwarden sim`) and the KV agent's CLI (`gpuwarden agent final-save`).
#
#   docker build -t gpuwarden:dev .
#
# The default developer path needs no Docker at all: `make run`.

ARG PYTHON_VERSION=3.11

# ---- build: install the project and its dependencies into a virtual environment ---------------------------------
FROM python:${PYTHON_VERSION}-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/gpuwarden
ENV PATH=/opt/gpuwarden/bin:$PATH

WORKDIR /src
# Only what the wheel is built from: the build context also holds .venv, tests and benchmarks.
# (README.m[d] is a glob so that this line does not fail on its own; pyproject.toml names README.md as the readme.)
COPY pyproject.toml README.m[d] ./
COPY shared/ shared/
COPY services/ services/
RUN pip install .

# ---- runtime ------------------------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim

ARG GPUWARDEN_UID=10001

# A fixed numeric user, so that Kubernetes' runAsNonRoot can check it. The directories are created here, owned by
# that user, so that named volumes mounted on them (compose) start out writable.
RUN groupadd --system --gid "${GPUWARDEN_UID}" gpuwarden \
 && useradd --system --uid "${GPUWARDEN_UID}" --gid gpuwarden \
        --home-dir /var/lib/gpuwarden --no-create-home --shell /usr/sbin/nologin gpuwarden \
 && mkdir -p /var/lib/gpuwarden/checkpoints /var/lib/gpuwarden/device-plugins \
 && chown -R gpuwarden:gpuwarden /var/lib/gpuwarden

COPY --from=build /opt/gpuwarden /opt/gpuwarden

ENV PATH=/opt/gpuwarden/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GPUWARDEN_HTTP_ADDR=0.0.0.0:8080

USER ${GPUWARDEN_UID}:${GPUWARDEN_UID}
WORKDIR /var/lib/gpuwarden

# 8080: /healthz, /readyz, /metrics of every service; 9090: the scaler's gRPC (KEDA externalscaler + grpc.health.v1).
EXPOSE 8080 9090

ENTRYPOINT ["gpuwarden"]
CMD ["--help"]
