#!/bin/sh
# Prepare any Debian/Ubuntu base for eyas: python3 with venv (from the OS when the base has none), the
# virtual environment /opt/venv that every image uses, and the non-root user `eyas` (uid 1000).
set -eu
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    apt-get update
    # shellcheck disable=SC2086  # EXTRA_APT is a list of package names
    apt-get install -y --no-install-recommends python3 python3-venv python3-dev ca-certificates ${EXTRA_APT:-}
    rm -rf /var/lib/apt/lists/*
fi
python3 -m venv /opt/venv
# Ubuntu images ship a user `ubuntu` with uid 1000: eyas takes that uid on every variant.
if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi
useradd --create-home --uid 1000 --shell /bin/sh eyas
