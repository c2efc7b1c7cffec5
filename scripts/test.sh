#!/usr/bin/env bash
# The whole test suite: lints, Rust unit/property/integration tests (both
# I/O drivers), the pure crate without its runtime, and the Python SDK tests.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${HIVENET_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check -r tests/python/requirements.txt

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo build --workspace --bins
# One test at a time: the integration tests start real processes and make
# timing assertions; running them side by side on 2 cores invites flakes.
cargo test --workspace -- --test-threads=1
cargo test -p shards --no-default-features
HIVENET_BIN_DIR="$PWD/target/debug" "$VENV/bin/python" -m pytest -q tests/python
