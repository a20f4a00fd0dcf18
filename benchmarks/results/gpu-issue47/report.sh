#!/bin/bash
# One poll of issue 47's sitting (drive.sh): the timeline, what each result says so far, the logs' last lines; with
# $OUT set, the results and the logs' tails go there too (what a device call brings back).
R=${R:-/tmp/results}
if [ -n "$OUT" ]; then
    mkdir -p $OUT
    cp $R/timeline.txt $R/ranges.json $R/packing.json $R/jobs_per_hour.json $OUT/ 2>/dev/null
    for log in build ranges packing jph; do tail -c 20000 $R/$log.log > $OUT/$log.log 2>/dev/null; done
    tail -c 6000 $R/dmon.txt > $OUT/dmon.txt 2>/dev/null
fi
cat $R/timeline.txt 2>/dev/null
python3 - "$R" <<'PY'
import json, sys
from pathlib import Path

r = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((r / name).read_text())
    except (OSError, ValueError):
        return None

if ranges := load("ranges.json"):
    print(f"ranges: {ranges['ranges']} at once {ranges['ranges_seconds']} s, serial {ranges['serial_seconds']} s")
if packing := load("packing.json"):
    for name, s in packing["sides"].items():
        print(f"packing {name}: {s['wall_seconds']} s, conversions {s['conversion_seconds']} s, SM mean "
              f"{s['gpu']['sm_mean']}%, max {s['gpu']['fb_max_mib']} MiB, actual/expected {s.get('predicted')}")
        print("   ", {k: (v["seconds"], v.get("expected_seconds")) for k, v in s["steps"].items()})
    print("packing speed:", packing.get("speed"))
if jph := load("jobs_per_hour.json"):
    for name, s in jph["sides"].items():
        print(f"jobs per hour {name}: {s['jobs_per_hour']} ({s['wall_seconds']} s, {s['worker_args']}), SM "
              f"{s.get('gpu_use')}, actual/expected {s.get('predicted')}")
    print("jobs per hour speed:", jph.get("speed"))
PY
tail -n 3 $R/build.log $R/ranges.log $R/packing.log $R/jph.log 2>/dev/null
