#!/bin/bash
# One poll of the session driver: what it has so far goes to $OUT (at most 8 files).
mkdir -p $OUT
R=/tmp/results W=/tmp/w
cp $R/timeline.txt $R/plan.json $R/measurement-8b.json $OUT/ 2>/dev/null
cp /tmp/repo/benchmarks/results/cost_growth.json $OUT/ 2>/dev/null
cat $W/8b-*.jsonl > $OUT/events.jsonl 2>/dev/null
{ tail -c 3000 $R/awq.log; tail -c 3000 $R/exl3.log; tail -c 3000 $R/exl2.log 2>/dev/null; tail -c 1500 $R/make.log; tail -c 1500 $R/build3.log;
  tail -c 1500 $R/build2.log; tail -c 1000 $R/pip.log; cat $R/plan.err; } > $OUT/logs.txt 2>/dev/null
{ tail -c 4000 $R/dmon.txt; tail -n 3 $R/free.txt; df -h /tmp; du -sh $W/* 2>/dev/null; } > $OUT/machine.txt
for f in $(find $W -name engine.log 2>/dev/null); do echo "== $f"; tail -c 2500 $f; done > $OUT/engine_logs.txt
cat $R/timeline.txt 2>/dev/null
grep -h '"event": "step"' $W/8b-*.jsonl 2>/dev/null | python3 -c "
import sys, json
for l in sys.stdin:
    e = json.loads(l); print(e['at'], e['step'], e['state'], e.get('expected_seconds', ''), e.get('seconds', ''), (e.get('error') or '')[:200])"
tail -n 2 $R/dmon.txt
