#!/usr/bin/env bash
# Builds the sandbox base image from Debian's packages, with no registry: debootstrap a minimal bookworm
# with python3 and git, then `docker import` it. Users with a registry build the Dockerfiles FROM a public
# image instead (BASE_IMAGE build argument). Idempotent: does nothing when the image exists.
#   containers/build-base.sh [IMAGE]        default agentrl/base:bookworm
set -euo pipefail
IMAGE=${1:-agentrl/base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE exists"
  exit 0
fi
command -v debootstrap >/dev/null || ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq debootstrap)
ROOTFS=$(mktemp -d)
trap '$SUDO rm -rf "$ROOTFS"' EXIT
echo "debootstrap bookworm into $ROOTFS (about 2 minutes)"
$SUDO debootstrap --variant=minbase --include=python3,git bookworm "$ROOTFS" "$MIRROR" >/dev/null
$SUDO rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
$SUDO tar -C "$ROOTFS" -c . | docker import -c 'CMD ["/bin/bash"]' - "$IMAGE"
echo "built $IMAGE"
