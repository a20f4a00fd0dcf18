#!/bin/bash
# One poll of the session driver: what it has so far goes to $OUT (8 files at most come back).
mkdir -p $OUT
R=/tmp/results
cp $R/timeline.txt $R/suite_smollm2.json $R/jobs_per_hour.json $R/cost_growth.json $OUT/ 2>/dev/null
tail -c 30000 $R/suite.log > $OUT/suite.log 2>/dev/null
tail -c 30000 $R/jph.log > $OUT/jph.log 2>/dev/null
tail -c 20000 $R/growth.log > $OUT/growth.log 2>/dev/null
tail -c 4000 $R/dmon.txt > $OUT/dmon.txt 2>/dev/null
cat $R/timeline.txt 2>/dev/null; tail -3 $R/suite.log $R/jph.log $R/growth.log $R/build.log 2>/dev/null
ls -la $R/exllamav2_ext.so 2>/dev/null
