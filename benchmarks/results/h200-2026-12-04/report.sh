#!/bin/bash
# One poll of the session driver: what it has so far goes to $OUT.
mkdir -p $OUT
R=/tmp/results
cp $R/timeline.txt $R/gpu_suite_vlm.json $OUT/ 2>/dev/null
cp /tmp/repo/benchmarks/results/coverage-h200.json $OUT/ 2>/dev/null
tail -c 30000 $R/exl3.log > $OUT/exl3.log 2>/dev/null
tail -c 20000 $R/gpu_test.log > $OUT/gpu_test.log 2>/dev/null
tail -c 3000 $R/build3.log > $OUT/build.log 2>/dev/null; tail -c 2000 $R/pip.log >> $OUT/build.log 2>/dev/null
tail -c 3000 $R/dmon.txt > $OUT/dmon.txt 2>/dev/null
for f in $(find /tmp/cov3 /tmp/pytest-of-* -name engine.log 2>/dev/null); do echo "== $f"; tail -c 2500 $f; done \
    > $OUT/engine_logs.txt
cat $R/timeline.txt 2>/dev/null; tail -3 $R/build3.log $R/pip.log 2>/dev/null | cut -c1-300
grep -E "^exl3 " $R/exl3.log 2>/dev/null | cut -c1-400; tail -3 $R/gpu_test.log 2>/dev/null | cut -c1-400
