#!/usr/bin/env bash
# Builds chatmesh's image (deploy/image/Containerfile) on a machine with podman and no registry: the Debian base
# comes from debootstrap instead of a pull. Elsewhere, build the Containerfile as it is:
#
#   podman build -f deploy/image/Containerfile -t registry.example.internal/chatmesh:0.1.0 .
#
# Here:  deploy/image/build.sh            (prints the image's size and the build's time;
#                                         CHATMESH_IMAGE_NO_CACHE=1: no layer cache, a cold build)
#
# 1. base: `debootstrap --variant=minbase bookworm` into a folder, imported as chatmesh-base:bookworm (Debian
#    bookworm's minimal set, what debian:bookworm-slim is made from); kept once made (CHATMESH_IMAGE_REBASE=1
#    makes it again).
# 2. image: `podman build --isolation=chroot` (the default isolation fails on cgroups in this sandbox) with
#    BASE=that image, the torch CPU wheel from this machine's disk (PyTorch's index is not reachable here; PyPI is),
#    and this machine's CA bundle for pip (its egress proxy re-signs TLS), mounted for the build only.
# Tagged localhost/chatmesh:VERSION (pyproject's version, the tag the overlays deploy) and localhost/chatmesh:dev.
set -euo pipefail
cd "$(dirname "$0")/../.."

VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
BASE=localhost/chatmesh-base:bookworm
IMAGE=localhost/chatmesh:$VERSION
TORCH_WHEELS=${CHATMESH_TORCH_WHEELS:-/opt/wheels}   # a folder holding torch-2.13.0+cpu-...whl
HOST_CA=${CHATMESH_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}

for tool in podman debootstrap; do
  command -v "$tool" >/dev/null \
    || { echo "build.sh: $tool not found (apt-get install podman debootstrap)" >&2; exit 2; }
done

if [ "${CHATMESH_IMAGE_REBASE:-0}" = 1 ] || ! podman image exists "$BASE"; then
  root=$(mktemp -d /var/tmp/chatmesh-base.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  start=$(date +%s)
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
  # what debian:bookworm-slim also has: the security and updates suites
  cat >"$root/etc/apt/sources.list" <<'EOF'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  echo "build.sh: base $BASE from debootstrap in $(( $(date +%s) - start )) s" >&2
fi

args=(--build-arg "BASE=$BASE")
mounts=()
if [ -d "$TORCH_WHEELS" ]; then
  args+=(--build-arg TORCH_WHEELS=/run/torch-wheels)
  mounts+=(-v "$TORCH_WHEELS:/run/torch-wheels:ro")
fi
if [ -f "$HOST_CA" ]; then
  args+=(--build-arg BUILD_CA_FILE=/run/build-ca.crt)
  mounts+=(-v "$HOST_CA:/run/build-ca.crt:ro")
fi

[ "${CHATMESH_IMAGE_NO_CACHE:-0}" = 1 ] && args+=(--no-cache)  # a cold build, to time it

start=$(date +%s)
podman build --isolation=chroot --pull=never "${args[@]}" "${mounts[@]}" \
  -f deploy/image/Containerfile -t "$IMAGE" -t localhost/chatmesh:dev .
seconds=$(( $(date +%s) - start ))
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
echo "build.sh: $IMAGE built in $seconds s, $(( size / 1000000 )) MB" >&2
