#!/usr/bin/env bash
# The precision study's runs (benchmarks/precision_study.py reads them): every arm of ARMS under --preset demo at
# depth 4, fp32 against bf16 residual streams, seed by seed and fp32 then bf16 within a seed, so that a study cut
# short still holds whole pairs (the analysis pairs the two dtypes by seed). Each launch prints its plan on this
# machine before it starts; rerunning the command continues the study (finished runs are skipped).
#
#   bash benchmarks/precision_runs.sh runs/precision                       # baseline,hc,mhc x 6 seeds
#   ARMS=kromhc SEEDS=42,123 bash benchmarks/precision_runs.sh runs/precision
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/precision_runs.sh OUT (ARMS, SEEDS, DEPTH from the environment)}
arms=${ARMS:-baseline,hc,mhc}
seeds=${SEEDS:-42,123,456,789,1000,2024}
depth=${DEPTH:-4}
for seed in ${seeds//,/ }; do
    for dtype in fp32 bf16; do
        bash run_experiments.sh --demo --residual "$arms" --depth "$depth" --seed "$seed" --out "$out/$dtype" \
            -- --stream-dtype "$dtype"
    done
done
