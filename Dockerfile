# memsvc image: the manager, the worker (one per GPU) and the OpenAI gateway run from it.
# Build stage: the same `make wheel` CI runs (native extension with its CUDA kernels; the gRPC stubs' wheel).
ARG CUDA_VERSION=13.0.1
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev make gcc \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN make wheel

# Runtime stage: no compiler, no toolkit; the driver comes from the host (NVIDIA container toolkit).
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04 AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 memsvc \
 && mkdir -p /var/lib/memsvc /var/cache/huggingface /models \
 && chown memsvc /var/lib/memsvc /var/cache/huggingface
# Both wheels of `make wheel`: memsvc depends on memsvc-api (the stubs), which pip takes from the file named.
COPY --from=build /src/dist/ /tmp/dist/
RUN python3 -m venv /opt/memsvc \
 && /opt/memsvc/bin/pip install --no-cache-dir "$(ls /tmp/dist/memsvc_api-*.whl)" "$(ls /tmp/dist/memsvc-*.whl)[worker,gateway,postgres]" \
 && rm -rf /tmp/dist
ENV PATH=/opt/memsvc/bin:$PATH \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/memsvc
EXPOSE 50051 50061 9400 8000
ENTRYPOINT ["memsvc"]
CMD ["--help"]
