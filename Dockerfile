# syntax=docker/dockerfile:1
# infersight agent as a sidecar container: slim, non-root, healthchecked.
#   docker build -t infersight .
#   docker run -v infersight-sock:/run/infersight infersight
# Model servers in other containers mount the same volume at /run/infersight
# (see deploy/kubernetes/pod.yaml).

FROM python:3.12-slim AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.12-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    INFERSIGHT_SOCKET=/run/infersight/agent.sock \
    INFERSIGHT_SPOOL_DIR=/var/lib/infersight/spool
# No NVIDIA_VISIBLE_DEVICES here on purpose: GPUs come from the orchestrator
# (device plugin / --gpus), never implicitly from the image.
RUN groupadd --system --gid 10001 infersight \
 && useradd --system --uid 10001 --gid infersight --no-create-home \
      --home-dir /var/lib/infersight --shell /usr/sbin/nologin infersight \
 && install -d -o infersight -g infersight -m 0750 /run/infersight /var/lib/infersight \
 && install -d -o infersight -g infersight -m 2770 /var/lib/infersight/spool
COPY --from=build /wheels /wheels
# The [grpc] extra: a ConfigMap's `protocol = "grpc"` needs it (without it the sidecar exited 2 and, as a native
# sidecar gating the model server's start, held the pod in Init:CrashLoopBackOff). EXTRAS="" builds without.
ARG EXTRAS=grpc
RUN set -- /wheels/infersight-*.whl \
 && pip install --no-cache-dir "$1${EXTRAS:+[$EXTRAS]}" && rm -rf /wheels
COPY systemd/infersight.toml /etc/infersight/infersight.toml
USER 10001:10001
VOLUME ["/run/infersight", "/var/lib/infersight"]
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["infersight", "status"]
ENTRYPOINT ["infersight", "agent"]
CMD ["--config", "/etc/infersight/infersight.toml"]
