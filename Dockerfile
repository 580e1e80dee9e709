# syntax=docker/dockerfile:1
# The envoy-epp image: `epp serve` as a non-root user, nothing but the picker's
# Python environment on top of a slim Python base.
#
#   docker build -t envoy-epp:0.1.0 .
#   docker run --rm -p 9002:9002 -p 9003:9003 -p 9090:9090 \
#     -v "$PWD/endpoints.yaml:/config/endpoints.yaml:ro" \
#     envoy-epp:0.1.0 --endpoints-file /config/endpoints.yaml
#
# The Helm chart (manifests/helm/inferencepool) relies on what is fixed here: the
# entrypoint `epp serve` (the chart passes flags only), UID/GID 10001, the ports
# 9002 (ext_proc), 9003 (gRPC health) and 9090 (metrics), the config files on
# /config (a ConfigMap) and /tmp as the one writable place (an emptyDir under the
# read-only root filesystem).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src

# The protobuf code generator lives in this stage only.
RUN python -m venv /opt/protoc \
    && /opt/protoc/bin/pip install grpcio-tools==1.85.1

# The runtime environment. The pinned dependencies first, in their own layer, so a
# code change does not reinstall them.
RUN python -m venv /opt/epp
COPY pyproject.toml setup.py README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && /opt/epp/bin/pip install -r /tmp/requirements.txt

COPY protos/ protos/
COPY epp/ epp/
COPY plugins/ plugins/
# Generates epp/_proto/ (never committed), then installs the package with its
# built-in plugins (plugins/, installed as epp.plugins) and their entry points; pip compiles the bytecode here, because nothing
# can write it at run time.
RUN /opt/protoc/bin/python protos/generate.py \
    && /opt/epp/bin/pip install --no-deps . \
    && /opt/epp/bin/epp --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="envoy-epp" \
      org.opencontainers.image.description="A prefix-cache-aware Endpoint Picker for Envoy (ext_proc)" \
      org.opencontainers.image.licenses="Apache-2.0"

# A numeric user, so Kubernetes can check runAsNonRoot without reading /etc/passwd.
RUN groupadd --system --gid 10001 epp \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /tmp --shell /usr/sbin/nologin epp
COPY --from=build /opt/epp /opt/epp

ENV PATH=/opt/epp/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface
WORKDIR /tmp
USER 10001:10001
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp", "serve"]
