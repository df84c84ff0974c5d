#!/usr/bin/env bash
# One-command set-up: a .venv with every package at its version in requirements-lock.txt (re-runs skip
# what is already installed), then a tiny forward pass to prove the install works.
#
#   bash setup.sh                     runtime dependencies
#   bash setup.sh --dev               plus the test tools (pytest, hypothesis, shellcheck)
#   bash setup.sh --flash-attn        plus flash-attn 2, from a prebuilt wheel only: PyPI has none, so put the
#                                     wheel for your torch, CUDA and Python where pip finds it (PIP_FIND_LINKS)
#   bash setup.sh --build-flash-attn  plus flash-attn 2, built from source when no wheel fits (hours without ninja)
#   bash setup.sh --prefetch-c4 N     also download the first N C4 train shards and the 8 validation
#                                     shards once (~320 MB each train shard) into --c4-dir (default data/c4)
# Without a flash-attn flag it is never installed, on a GPU node neither: PyTorch's SDPA attention is used.
set -euo pipefail
cd "$(dirname "$0")"

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }

DEV=0
FLASH_ATTN=none
PREFETCH=0
C4_DIR=data/c4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dev) DEV=1 ;;
    --flash-attn) [[ $FLASH_ATTN == build ]] || FLASH_ATTN=wheel ;;
    --build-flash-attn) FLASH_ATTN=build ;;
    --prefetch-c4)
      [[ ${2:-} =~ ^[0-9]+$ && $2 -ge 1 && $2 -le 1024 ]] ||
        { echo "setup.sh: --prefetch-c4 needs a shard count from 1 to 1024" >&2; exit 2; }
      PREFETCH=$2; shift ;;
    --c4-dir)
      [[ -n ${2:-} ]] || { echo "setup.sh: --c4-dir needs a folder" >&2; exit 2; }
      C4_DIR=$2; shift ;;
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
[[ $DEV == 1 ]] && requirements="requirements-dev.txt"
# every package, dependencies of dependencies included, at the version of the lock (a constraint installs
# nothing by itself), so nodes set up weeks apart run the same code
lock=(-c requirements-lock.txt)
# the stamp names exactly what was installed, so an unchanged re-run costs no pip call at all
stamp=".venv/.installed-$(cat requirements.txt "$requirements" requirements-lock.txt | sha256sum | cut -c1-16)"
if [[ ! -e $stamp ]]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r "$requirements" "${lock[@]}"
  touch "$stamp"
fi

.venv/bin/python - <<'PY'
import torch
import train_c4 as T

cfg = T.parse_config(["--preset", "tiny", "--residual", "mhc"])
logits = T.GPT(cfg)(torch.zeros(1, 8, dtype=torch.long))
assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()
cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "CPU only"
print(f"setup.sh: ready (torch {torch.__version__}, {cuda}). Next: bash run_experiments.sh --demo (CPU minutes)"
      + (" or --check (this node's GPU path)" if torch.cuda.is_available() else "")
      + "; the trainer is .venv/bin/python train_c4.py --help (or run 'source .venv/bin/activate' first)")
PY

if [[ $PREFETCH -gt 0 ]]; then
  .venv/bin/python -m hcstudy.c4_download "$PREFETCH" "$C4_DIR" || exit 6
fi

# last, so that a failed opt-in leaves everything else done
if [[ $FLASH_ATTN != none ]] && ! .venv/bin/python -c 'import flash_attn' 2>/dev/null; then
  wheel_only=(--only-binary flash-attn)
  [[ $FLASH_ATTN == build ]] && wheel_only=()
  # no build isolation: a source build compiles against the torch installed above
  .venv/bin/python -m pip install --quiet --no-build-isolation "${wheel_only[@]}" -r requirements-gpu.txt \
    "${lock[@]}" || {
    echo "setup.sh: flash-attn did not install (pip's reason above; without --build-flash-attn only a prebuilt wheel" \
      "is taken, from PIP_FIND_LINKS); the rest is ready and trains with PyTorch SDPA attention" >&2
    exit 1
  }
fi
