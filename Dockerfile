# tokend server image, used by docker-compose.yml (Redis runs as its own service).
#   docker build -t tokend .                           the server
#   docker build -t tokend-load --build-arg EXTRAS=load .   plus locust and load_tests/
FROM python:3.11-slim

# Extras of the package to install: "load" adds locust for the compose `load` profile.
ARG EXTRAS=""

RUN useradd --system --uid 10001 --home-dir /data tokend \
    && mkdir -p /data /keys \
    && chown tokend /data /keys

WORKDIR /app
COPY pyproject.toml README.md ./
COPY tokend ./tokend
# The Python SDK, which the server's wheel carries (tokend connect, the load tests).
COPY sdk/python/tokend_client ./sdk/python/tokend_client
COPY load_tests ./load_tests
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"

USER tokend
# Listen on every interface of the container; the nodes of a deployment share the
# signing keys (one volume at /keys) and a Redis: set TOKEND_REDIS_URL (the image
# has no embedded redis-server).
ENV TOKEND_HOST=0.0.0.0 \
    TOKEND_PORT=8765 \
    TOKEND_DATA_DIR=/data \
    TOKEND_KEYS_DIR=/keys
EXPOSE 8765
# Shell form, so that a TOKEND_PORT given at run time is the one checked.
HEALTHCHECK --interval=5s --timeout=3s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${TOKEND_PORT}/readyz', timeout=2)"
CMD ["tokend", "serve"]
