#!/bin/bash
# One poll of the session driver: what it has so far goes to $OUT (at most 8 files).
mkdir -p $OUT
R=/tmp/results W=/tmp/w
cp $R/timeline.txt $R/plan.json $R/measurement-8b.json $OUT/ 2>/dev/null
cp /tmp/repo/benchmarks/results/cost_growth.json $OUT/ 2>/dev/null
for f in $W/*.jsonl; do sed "s/^{/{\"log\": \"$(basename $f .jsonl)\", /" $f; done > $OUT/events.jsonl 2>/dev/null
{ for f in $R/*.log; do echo "== $f"; tail -c 2000 $f; done;
  cat $R/plan.err; } > $OUT/logs.txt 2>/dev/null
{ tail -c 4000 $R/dmon.txt; df -h /tmp; du -sh $W/* 2>/dev/null; } > $OUT/machine.txt
for f in $(find $W -name engine.log 2>/dev/null); do echo "== $f"; tail -c 2500 $f; done > $OUT/engine_logs.txt
cat $R/timeline.txt 2>/dev/null
grep -H '"event": "step"' $W/*.jsonl 2>/dev/null | sed 's|^.*/\([^/]*\)\.jsonl:|\1 |' | python3 -c "
import sys, json
for l in sys.stdin:
    log, l = l.split(' ', 1); e = json.loads(l); print(log, e['at'], e['step'], e['state'], e.get('expected_seconds', ''), e.get('seconds', ''), (e.get('error') or '')[:200])"
tail -n 2 $R/dmon.txt
