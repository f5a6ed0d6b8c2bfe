#!/usr/bin/env bash
# The whole `docker compose` check as one command (docs/DEPLOY.md): a Docker engine (started here if
# none runs and this is root), every image built with no container registry (local debootstrap base,
# Debian and PyPI packages), the stack up with 2 prefill, 2 decode and 2 gateway replicas, then through
# nginx: greedy completions equal transformers, streaming, prefix reuse; Prometheus targets; a request's
# spans; a decode crash healed; NATS lost for good and back; `down -v` leaves nothing.
#   infra/compose-check.sh [--online] [--keep] [--skip heal,nats-loss] [--project NAME]
# Exit 0 when the stack served and healed, 77 when no engine can be had (the reason is printed), else 1.
# The last line is a one-line summary. Details: infra/compose_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${HALFMOON_CHECK_PYTHON:-}
if [[ -z "$python" ]]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      python=$candidate
      break
    fi
  done
fi
[[ -n "$python" ]] || { echo "compose-check: SKIP (no python3 >= 3.11 on this host)"; exit 77; }
exec "$python" infra/compose_check.py "$@"
