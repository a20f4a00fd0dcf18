#!/bin/bash
# One poll of the session driver: what it has so far goes to $OUT (8 files at most come back).
mkdir -p $OUT
R=/tmp/results
cp $R/timeline.txt $R/gpu_kld_8b.json $R/gpu_kld_cost.json $R/suite_smollm2.json $R/jobs_per_hour.json $OUT/ 2>/dev/null
tail -c 20000 $R/kld.log > $OUT/kld.log 2>/dev/null
tail -c 20000 $R/suite.log > $OUT/suite.log 2>/dev/null
tail -c 20000 $R/jph.log > $OUT/jph.log 2>/dev/null
cat $R/timeline.txt 2>/dev/null; tail -3 $R/kld.log $R/suite.log $R/jph.log $R/build.log 2>/dev/null
tail -2 $R/dmon.txt 2>/dev/null
