#!/bin/bash
# Rounds of two or more servers alternating, one side-by-side run each, the read bandwidth
# measured before each: bash rounds.sh OUT SERVERS [ROUNDS] [PEERS_DIR]
# (SERVERS as side-by-side's --servers, e.g. tandem-disagg-int8,tandem-disagg)
set -e
out=${1:?usage: rounds.sh OUT SERVERS [ROUNDS] [PEERS_DIR]}
servers=${2:?usage: rounds.sh OUT SERVERS [ROUNDS] [PEERS_DIR]}
rounds=${3:-3}
peers=${4:-/root/peers}
mkdir -p "$out"
cd "$(git rev-parse --show-toplevel)"
for r in $(seq 1 "$rounds"); do
  python -m bench.lab.bandwidth --model "$peers/models/small-llama" --dtype-bytes 1 > "$out/bw-$r.txt" 2>&1
  timeout 1500 python -m bench.lab.peers side-by-side small "$out/round$r" --dir "$peers" -n 100 \
    --tandem-args "--kv-cache-memory-gb 4" --servers "$servers" > "$out/round$r.log" 2>&1
done
