#!/usr/bin/env bash
# One-command set-up: a .venv with the pinned requirements (re-runs skip what is already installed),
# flash-attn only where nvidia-smi finds a GPU, then a tiny forward pass to prove the install works.
#
#   bash setup.sh          runtime dependencies
#   bash setup.sh --dev    plus the test tools (pytest, hypothesis, shellcheck)
set -euo pipefail
cd "$(dirname "$0")"

usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }

DEV=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dev) DEV=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "setup.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup.sh: needs Python >= 3.10 as '$PYTHON' (set PYTHON=/path/to/python3.11)" >&2
  exit 2
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv

requirements=requirements.txt
[[ $DEV == 1 ]] && requirements=requirements-dev.txt
# the stamp names exactly what was installed, so an unchanged re-run costs no pip call at all
stamp=".venv/.installed-$(cat requirements.txt "$requirements" | sha256sum | cut -c1-16)"
if [[ ! -e $stamp ]]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r "$requirements"
  touch "$stamp"
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  if ! .venv/bin/python -c 'import flash_attn' 2>/dev/null; then
    echo "setup.sh: GPU found, installing flash-attn (a source build can take a while)"
    .venv/bin/python -m pip install --quiet --no-build-isolation -r requirements-gpu.txt ||
      echo "setup.sh: warning: flash-attn did not install; training uses PyTorch SDPA attention instead" >&2
  fi
fi

.venv/bin/python - <<'PY'
import torch
import train_c4 as T

cfg = T.parse_config(["--preset", "tiny", "--residual", "mhc"])
logits = T.GPT(cfg)(torch.zeros(1, 8, dtype=torch.long))
assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()
cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "CPU only"
print(f"setup.sh: ready (torch {torch.__version__}, {cuda}); try: bash run_experiments.sh --demo")
PY
