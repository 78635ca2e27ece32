#!/usr/bin/env bash
# Prepare a fresh machine: .venv, dependencies and the exported Whisper graphs.
#   scripts/setup.sh          what `streamasr serve` needs (CPU, ONNX Runtime, Whisper tiny.en)
#   scripts/setup.sh --test   plus the test tools, Whisper base and the test speech (Debian packages)
set -euo pipefail
cd "$(dirname "$0")/.."

case "$*" in
    "") with_tests=0 ;;
    --test) with_tests=1 ;;
    *) echo "usage: scripts/setup.sh [--test]" >&2; exit 2 ;;
esac

if [ "$with_tests" = 1 ]; then
    apt_packages="pocketsphinx-testdata espeak-ng sox chromium"
    missing=""
    # installed, not merely known to dpkg: a package removed but not purged still has a status
    for p in $apt_packages; do
        [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || missing="$missing $p"
    done
    if [ -n "$missing" ]; then
        if [ "$(id -u)" != 0 ]; then echo "need root to install:$missing" >&2; exit 1; fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    fi
fi

# Python 3.11 or later with its venv module (Debian ships that apart, in python3-venv)
python_ok() { command -v python3 >/dev/null && python3 -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
# a .venv an earlier run left without pip (its venv module missing then) is made again
venv_ok() { [ -x .venv/bin/python ] && .venv/bin/python -c 'import pip' 2>/dev/null; }
if ! venv_ok && ! python_ok; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "need Python 3.11 or later with its venv module (Debian: apt-get install python3 python3-venv)" >&2; exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >/dev/null
    python_ok || { echo "python3 is $(python3 --version 2>&1): 3.11 or later is needed" >&2; exit 1; }
fi
venv_ok || python3 -m venv --clear .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ "$with_tests" = 1 ]; then
    .venv/bin/python -m pip install -q -e '.[test,base,bench]'
else
    .venv/bin/python -m pip install -q -e .
fi
.venv/bin/streamasr export --model whisper-tiny.en
