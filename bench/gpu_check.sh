#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): real trainers on one GPU under `ckptd exec`, a
# loopback SeaweedFS, no network; under 8 minutes on one GPU. `--device cpu --short` is
# the CI variant. Runs from any directory; PYTHON picks the interpreter (default: the
# repository's .venv, else python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
cd "$repo"
exec "$python" bench/gpu_check.py "$@"
