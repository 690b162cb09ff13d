#!/bin/bash
# Three rounds of int8 and bf16 colocated, one side-by-side run each (int8 first), the
# read bandwidth measured before each: bash rounds.sh OUT [PEERS_DIR]
set -e
out=${1:?usage: rounds.sh OUT [PEERS_DIR]}
peers=${2:-/root/peers}
mkdir -p "$out"
cd "$(git rev-parse --show-toplevel)"
for r in 1 2 3; do
  python -m bench.lab.bandwidth --model "$peers/models/small-llama" --dtype-bytes 1 > "$out/bw-$r.txt" 2>&1
  timeout 1200 python -m bench.lab.peers side-by-side small "$out/round$r" --dir "$peers" -n 100 \
    --tandem-args "--kv-cache-memory-gb 4" --servers tandem-colocated-int8,tandem-colocated > "$out/round$r.log" 2>&1
done
