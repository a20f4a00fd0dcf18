#!/bin/bash
# One poll of the session driver: what it has so far goes to $OUT (8 files at most come back).
mkdir -p $OUT
cp /tmp/results/timeline.txt /tmp/results/packing.json /tmp/results/packing.log /tmp/results/build2.log $OUT/ 2>/dev/null
for side in packed one_at_a_time; do cp /tmp/bench/$side/catalog.db $OUT/catalog-$side.db 2>/dev/null; done
cat /tmp/results/timeline.txt 2>/dev/null; tail -5 /tmp/results/packing.log /tmp/results/build2.log 2>/dev/null
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
