#!/bin/bash
# One poll of the session driver: what it has so far goes to $OUT (8 files at most come back).
mkdir -p $OUT
R=/tmp/results
cp $R/timeline.txt $R/coverage-h200.json $R/coverage-h200-exl3.json $OUT/ 2>/dev/null
tail -c 20000 $R/exl2.log > $OUT/exl2.log 2>/dev/null
tail -c 20000 $R/exl3.log > $OUT/exl3.log 2>/dev/null
tail -c 3000 $R/build2.log $R/build3.log $R/pip.log > $OUT/build.log 2>/dev/null
tail -c 3000 $R/dmon.txt > $OUT/dmon.txt 2>/dev/null
cat $R/timeline.txt 2>/dev/null; grep -c quantized $R/exl2.log $R/exl3.log 2>/dev/null; grep -c refused $R/exl2.log $R/exl3.log 2>/dev/null
tail -2 $R/build2.log $R/build3.log 2>/dev/null | cut -c1-300
