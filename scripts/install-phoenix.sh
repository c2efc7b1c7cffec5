#!/usr/bin/env bash
# The OTLP receiver the trace tests export to: Arize Phoenix from PyPI
# (accepts OTLP/HTTP protobuf at /v1/traces, stores the spans in SQLite,
# serves them back at /v1/projects/{project}/spans). Installed into its own
# virtualenv in a cache outside the clone, keyed by its pinned version, so
# a second run takes a second (the first: about 2 minutes, ~860 MB).
# Prints:
#   PHOENIX=<path to the phoenix command>
# Usage: scripts/install-phoenix.sh   (env HIVENET_CACHE, default ~/.cache/hivenet)
set -euo pipefail
PHOENIX_VERSION=20.26.1
CACHE="${HIVENET_CACHE:-$HOME/.cache/hivenet}"
DIR="$CACHE/arize-phoenix-$PHOENIX_VERSION-py$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
# A stamp marks a whole install (a venv's scripts name their interpreter
# by path, so it is built in place; an interrupted one is started over).
if [ ! -f "$DIR/.installed" ]; then
  echo "install-phoenix: installing arize-phoenix $PHOENIX_VERSION (about 2 minutes)" >&2
  rm -rf "$DIR"
  python3 -m venv "$DIR"
  "$DIR/bin/pip" install -q --disable-pip-version-check "arize-phoenix==$PHOENIX_VERSION" >&2
  touch "$DIR/.installed"
fi
echo "PHOENIX=$DIR/bin/phoenix"
