#!/usr/bin/env bash
# Runs the smoke turn (deploy/image/smoke.py) inside a built image's files, as the image's user, without a
# container runtime (`podman run` is refused in this sandbox): `podman image mount` (read-only, as the manifests'
# readOnlyRootFilesystem), then chroot in private mount, PID and network namespaces: its own loopback (so the
# mesh's default ports are free whatever else runs here), /proc, and tmpfs at /tmp, /dev/shm and
# /var/lib/chatmesh (the manifests' emptyDirs). Needs root. Prints smoke.py's JSON line; exits with its status.
#
#   deploy/image/smoke.sh [IMAGE]      (default localhost/chatmesh:dev)
set -euo pipefail
cd "$(dirname "$0")"
IMAGE=${1:-localhost/chatmesh:dev}
[ "$(id -u)" = 0 ] || { echo "smoke.sh: needs root (mount, chroot, namespaces)" >&2; exit 2; }

root=$(podman image mount "$IMAGE")
trap 'podman image unmount "$IMAGE" >/dev/null' EXIT
# What the image says it runs as and with (its USER, WORKDIR and ENV), so the chroot runs the same way.
user=$(podman image inspect --format '{{.Config.User}}' "$IMAGE")
workdir=$(podman image inspect --format '{{.Config.WorkingDir}}' "$IMAGE")
mapfile -t env < <(podman image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$IMAGE" | sed '/^$/d')

unshare --mount --net --pid --fork --mount-proc="$root/proc" -- \
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin ROOT="$root" USERSPEC="$user" WORKDIR="$workdir" bash -c '
    set -euo pipefail
    ip link set lo up
    mount -t tmpfs -o mode=1777 tmpfs "$ROOT/tmp"
    mount -t tmpfs -o mode=1777 tmpfs "$ROOT/dev/shm"
    mount -t tmpfs -o "mode=0750,uid=${USERSPEC%%:*},gid=${USERSPEC##*:}" tmpfs "$ROOT$WORKDIR"
    exec chroot --userspec="$USERSPEC" "$ROOT" /usr/bin/env -i "$@" sh -c "cd \"$WORKDIR\" && exec python3 -"
  ' smoke "${env[@]}" < smoke.py
