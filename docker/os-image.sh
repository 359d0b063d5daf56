#!/bin/sh
# A Debian base OS image made without any container registry: debootstrap from the Debian mirror apt
# already uses, then `docker import`. The cpu and slim bases build on it (make os-image; BASE_OS=NAME).
# usage: docker/os-image.sh NAME [SUITE] [MIRROR]      (root; needs debootstrap and a docker engine)
set -eu
name=$1
suite=${2:-bookworm}
mirror=${3:-$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p; s/^deb  *\(http[^ ]*\) .*/\1/p' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -m1 debian || echo http://deb.debian.org/debian)}
if docker image inspect "$name" >/dev/null 2>&1; then
    echo "$name: already there"
    exit 0
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# python3 3.11 (bookworm) matches the cp311 CPU torch wheel; passwd brings useradd for the image user
debootstrap --variant=minbase --include=python3,python3-venv,passwd,ca-certificates "$suite" "$dir" "$mirror"
rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
tar -C "$dir" -c . | docker import - "$name"
