# The kubetrain operator image: `python -m kubetrain.operator` (kopf), no torch.
#
# Build from the repository root:
#   docker build -t ghcr.io/kubetrain/operator:0.1.0 .
# It runs as uid/gid 65532 with a read-only root filesystem (the Helm chart mounts /tmp);
# the chart passes --liveness, --namespace and --peering as arguments.
ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

# ---- build: wheels for kubetrain-core and kubetrain-operator into a virtualenv
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY core/pyproject.toml core/pyproject.toml
COPY core/src core/src
COPY operator/pyproject.toml operator/pyproject.toml
COPY operator/src operator/src
RUN python -m venv /opt/kubetrain \
    && /opt/kubetrain/bin/pip install ./core ./operator \
    && /opt/kubetrain/bin/python -c "import kubetrain.operator.handlers, sys; assert 'torch' not in sys.modules" \
    && /opt/kubetrain/bin/python -m compileall -q /opt/kubetrain

# ---- runtime: the virtualenv only
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kubetrain-operator" \
      org.opencontainers.image.description="Kubernetes operator for distributed PyTorch training" \
      org.opencontainers.image.source="https://github.com/kubetrain/kubetrain" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/kubetrain/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TMPDIR=/tmp
COPY --from=build /opt/kubetrain /opt/kubetrain
RUN groupadd --system --gid 65532 kubetrain \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kubetrain
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "kubetrain.operator"]
