# Test harness only: a stand-in for the public python:3.11-slim image, built from a local debootstrap rootfs
# (imported as local/debian:bookworm) on machines that reach no image registry. Debian 12's Python is 3.11,
# as in python:3.11-slim. deploy/test_image.sh builds it and tags it with the public name the Dockerfile uses.
FROM local/debian:bookworm
# hadolint ignore=DL3008
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        python3 python3-venv python-is-python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
