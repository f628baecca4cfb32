#!/usr/bin/env bash
# Build the statestore container image with podman (`make image`), from a Debian base image built here.
#
#   scripts/image.sh base    # the base image only: debootstrap'd bookworm + python3, imported with `podman import`
#   scripts/image.sh build   # the base (when missing), then deploy/Dockerfile on top of it
#
# Container registries need not be reachable: the base comes from Debian's mirror through debootstrap, and its root
# filesystem is cached ($STATESTORE_IMAGE_CACHE, default ~/.cache/statestore) so later builds cost only the
# Dockerfile's steps. pip inside the build uses the host's CA bundle (mounted read-only). Environment:
#   STATESTORE_IMAGE        tag of the image to build (default localhost/statestore:dev)
#   STATESTORE_BASE_IMAGE   tag of the base image (default localhost/statestore-base:bookworm-python3)
#   DEBIAN_MIRROR           debootstrap's mirror (default http://deb.debian.org/debian)
set -euo pipefail
cd "$(dirname "$0")/.."

image="${STATESTORE_IMAGE:-localhost/statestore:dev}"
base="${STATESTORE_BASE_IMAGE:-localhost/statestore-base:bookworm-python3}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cache="${STATESTORE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/statestore}"
rootfs="$cache/bookworm-python3-rootfs.tar"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/deploy/podman/containers.conf}"
podman=(podman --runtime runc --cgroup-manager=cgroupfs)

for tool in podman debootstrap; do
  if ! command -v "$tool" >/dev/null 2>&1 && ! [ -x "/usr/sbin/$tool" ]; then
    echo "scripts/image.sh: $tool is not installed (Debian: apt-get install podman debootstrap runc)" >&2
    exit 3
  fi
done
PATH="$PATH:/usr/sbin:/sbin"

build_rootfs() {
  mkdir -p "$cache"
  local target
  target="$(mktemp -d "$cache/rootfs.XXXXXX")"
  echo "debootstrap: Debian bookworm (minbase) with python3 into $target" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$target" "$mirror" >&2
  rm -rf "$target"/var/cache/apt/archives/*.deb "$target"/var/lib/apt/lists/*
  tar --numeric-owner -C "$target" -cf "$rootfs.partial" .
  mv "$rootfs.partial" "$rootfs"
  rm -rf "$target"
}

ensure_base() {
  if "${podman[@]}" image exists "$base"; then
    return
  fi
  [ -s "$rootfs" ] || build_rootfs
  "${podman[@]}" import --change 'CMD ["python3"]' "$rootfs" "$base" >&2
}

build_image() {
  ensure_base
  # --network host: the build's pip reaches the package index as the host does.
  "${podman[@]}" build --network host --format docker \
    --volume /etc/ssl/certs:/etc/ssl/certs:ro \
    --build-arg PYTHON_IMAGE="$base" \
    --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    -f deploy/Dockerfile -t "$image" . >&2
  echo "$image"
}

case "${1:-build}" in
  base) ensure_base ;;
  build) build_image ;;
  *) echo "usage: scripts/image.sh [base|build]" >&2; exit 2 ;;
esac
