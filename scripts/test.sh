#!/usr/bin/env bash
# The whole test suite: lints, Rust unit/property/integration tests (the
# default driver; agent_loss also on epoll), the pure crate without its
# runtime, the Python SDK tests (on io_uring and on epoll), a short soak and
# a bounded run of every fuzz target.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages the tests need: python3-venv (SDK tests), curl,
# promtool (Debian package prometheus) for the /metrics check, and perf
# (linux-perf) to count system calls per request. Installed
# when missing and we are root; otherwise say what to install.
need=()
python3 -m venv --help >/dev/null 2>&1 || need+=(python3-venv)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v perf >/dev/null 2>&1 || need+=(linux-perf)
# Tests that need a tool fail without it (no silent skips): systemd-analyze
# checks the units, chattr makes the store's files unwritable.
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v chattr >/dev/null 2>&1 || need+=(e2fsprogs)
# openssl makes the certificates of the provider-fallback TLS test.
command -v openssl >/dev/null 2>&1 || need+=(openssl)
# redis-server: the routers sharing keys through --shared-state
# (tests/shared_state.rs starts its own instances on free ports).
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# ip: the several-host fleet of network namespaces (tests/fleet_*.rs).
command -v ip >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"
  else
    echo "scripts/test.sh: please install the Debian packages: ${need[*]}" >&2
    exit 1
  fi
fi

VENV="${HIVENET_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check -r tests/python/requirements.txt

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo build --workspace --bins
# The real engine (llama-server + SmolLM2-135M), cached outside the clone
# by version: about 7 minutes the first time on 2 cores, a second after.
# tests/llama_real.rs runs it too; here its build time shows on its own.
scripts/install-llama.sh
# The OTLP receiver of tests/traces.rs (Arize Phoenix from PyPI), cached
# outside the clone by version: about 2 minutes the first time.
scripts/install-phoenix.sh
# One test at a time: the integration tests start real processes and make
# timing assertions; running them side by side on 2 cores invites flakes.
cargo test --workspace -- --test-threads=1
cargo test -p shards --no-default-features
# The KEDA query as a recording rule, and the alert rules, on synthetic
# series (tests/prometheus.rs also loads the alerts into a real Prometheus
# scraping a real router).
(cd deploy/keda && promtool test rules rules-test.yaml)
(cd deploy/prometheus && promtool check rules alerts.yaml && promtool test rules alerts-test.yaml)
# Kubernetes manifests against the schemas kubernetes-validate bundles
# (strict: unknown fields fail).
"$VENV/bin/kubernetes-validate" --quiet --strict deploy/kubernetes/*.yaml
HIVENET_BIN_DIR="$PWD/target/debug" "$VENV/bin/python" -m pytest -q tests/python

# System calls per proxied request (router, agent) at 1 and 16
# connections and per streamed event, against generous ceilings: a change
# that doubles a count fails (figures: perf/2026-12-01-fixed-count). A
# fixed number of requests per run, about 2 s each on a debug build.
REQS_1=2000 REQS_16=6000 REQS_STREAM=1000 scripts/count-syscalls.sh --check

# A short soak: mixed traffic with agents killed and restarted, then no
# leftovers (slots, queue entries, bodies, connections) and a flat RSS.
python3 scripts/soak.py "$PWD/target/debug" "${SOAK_SECONDS:-20}" >/dev/null

# Fuzz targets (shards/fuzz: HTTP heads, chunked decoder, link codecs,
# policy YAML, client and site input), each for a bounded time from the committed corpus; new
# inputs go to a scratch directory, a crash fails the suite.
command -v cargo-fuzz >/dev/null 2>&1 || cargo install -q --locked cargo-fuzz
FUZZ_SECONDS="${FUZZ_SECONDS:-10}"
scratch="$(mktemp -d)"
for t in request_head response_head chunked link_codecs policy_yaml client_input site_input; do
  mkdir -p "$scratch/$t"
  if ! (cd shards && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none "$t" "$scratch/$t" "fuzz/corpus/$t" -- \
      -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 >"$scratch/$t.log" 2>&1); then
    tail -n 30 "$scratch/$t.log" >&2
    echo "fuzz target $t failed (a crash input is in shards/fuzz/artifacts/$t)" >&2
    exit 1
  fi
  echo "fuzz $t: $(grep -E '^Done' "$scratch/$t.log")"
done
rm -rf "$scratch"
