# welder with GPU support: nvcc from the CUDA devel image, pycuda built against it.
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv cmake g++ \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/welder-venv PATH=/opt/welder-venv/bin:$PATH
RUN python3 -m venv "$VIRTUAL_ENV"

WORKDIR /opt/welder
COPY . .
RUN pip install --no-cache-dir -e ".[gpu,test]"

CMD ["welder", "--help"]
