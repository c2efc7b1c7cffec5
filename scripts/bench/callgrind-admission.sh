#!/usr/bin/env bash
# Instructions per request, no policy vs scripts/bench/admission-policy.yaml
# (B1 caps, B3 shed over engine signals, B2 reservation and release with
# estimator learning: every gate runs, none refuses).
#
# usage: scripts/bench/callgrind-admission.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ON_ARGS="--policy-file $PWD/scripts/bench/admission-policy.yaml" exec scripts/bench/callgrind-price.sh
