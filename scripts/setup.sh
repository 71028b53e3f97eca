#!/usr/bin/env bash
# Creates .venv and installs demo-lightning with its test extras (idempotent: reinstalls only when
# pyproject.toml changed). pip takes the torch wheels this machine already has on disk (see
# DEVELOPERS notes: /etc/xdg/pip caps torch at 2.14.1); set PYTHON to pick another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=.venv/.demo-lightning-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
  echo "$want" > "$stamp"
fi
