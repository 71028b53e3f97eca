#!/usr/bin/env bash
# Quick start 2: set up, then run the test suite (CPU, gloo, real processes). .ci/run calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
