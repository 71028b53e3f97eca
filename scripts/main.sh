#!/usr/bin/env bash
# Quick start 1: set up, then train the small GPT with strategy="demo" on 2 CPU processes.
# Extra arguments go to examples/train_gpt.py (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_gpt.py "$@"
