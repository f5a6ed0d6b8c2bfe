#!/usr/bin/env bash
# Makes the local base image the offline build starts from, with no container registry:
#   debootstrap (Debian bookworm, minbase + python3, python3-venv, ca-certificates) | docker import.
# Usage: infra/make-base-image.sh [IMAGE]        (default: halfmoon-base:bookworm; root, needs debootstrap)
# Environment: HALFMOON_DEBIAN_MIRROR (default: the first Debian mirror apt on this machine uses, else
# http://deb.debian.org/debian), HALFMOON_BASE_FORCE=1 to remake an existing image.
# The host's locally added CA certificates (/usr/local/share/ca-certificates) are trusted in the image,
# so builds FROM it reach package registries through the same TLS-intercepting proxy the host uses.
set -euo pipefail
image=${1:-halfmoon-base:bookworm}
docker=${DOCKER:-docker}
if [[ "${HALFMOON_BASE_FORCE:-0}" != 1 ]] && $docker image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image exists (HALFMOON_BASE_FORCE=1 remakes it)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }
mirror=${HALFMOON_DEBIAN_MIRROR:-}
if [[ -z "$mirror" ]]; then
  mirror=$(grep -rhoE '^(URIs:|deb) +[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
    | grep -oE '[a-z]+://[^ ]+' | head -n1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi
rootfs=$(mktemp -d "${TMPDIR:-/tmp}/halfmoon-rootfs.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT
start=$SECONDS
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" >&2
if compgen -G "/usr/local/share/ca-certificates/*" >/dev/null; then
  cp -r /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/"
  chroot "$rootfs" update-ca-certificates >&2
fi
# Small: no apt lists, package caches, docs, man pages or locales (apt-get update refills the lists).
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\npath-exclude /usr/share/locale/*\n' \
  > "$rootfs/etc/dpkg/dpkg.cfg.d/01-halfmoon-nodoc"
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' > "$rootfs/etc/apt/apt.conf.d/01-halfmoon-norecommends"
tar -C "$rootfs" -c . | $docker import \
  -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  -c 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "base image $image from $mirror in $((SECONDS - start)) s, $($docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%d MB", $1/1e6}')"
