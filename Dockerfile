# welder with GPU support: nvcc from the CUDA devel image, pycuda built against it.
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv cmake g++ \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/welder-venv PATH=/opt/welder-venv/bin:$PATH
RUN python3 -m venv "$VIRTUAL_ENV"

WORKDIR /opt/welder
COPY . .
# pycuda links against libcuda, which the devel image has only as a stub; the driver's
# real library is mounted when a container runs on a GPU host.
RUN LIBRARY_PATH=/usr/local/cuda/lib64/stubs pip install --no-cache-dir -e ".[gpu,test]"

CMD ["welder", "--help"]
