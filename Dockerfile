# The image of the profstream services in docker-compose.yml (processors and sinks):
#   docker build -t profstream:local .
#   docker run --rm profstream:local profstream --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY profstream ./profstream
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /app profstream
# `profstream grafana push` uploads these (run from /app, its default --dir is ./dashboards).
COPY dashboards/*.json ./dashboards/

USER profstream
CMD ["profstream", "--help"]
