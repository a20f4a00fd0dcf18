#!/bin/bash
# The 8B's third sitting (issue 44): drive2.sh's three jobs again, after the two mends its run called for (jobs of one
# source share one snapshot, so the disk holds the source twice, not four times; AWQ-CT sums its losses in float32),
# and with the EXL2 measurement now in layer ranges measured at once (issue 47, factory/engines/exl2/ranges.py).
# exllamav3's build is the critical chain's first link (435 s with 8 jobs beside exllamav2's in sitting 2; its job
# about 1090 s after), so it gets most of the 16 cores.
# Start as drive2.sh (report.sh polls it), carrying .whl and .commit:
#   cp -a . /tmp/repo && cd /tmp/repo && setsid nohup bash benchmarks/results/gpu-2026-12-06/drive3.sh &
source /tmp/repo/benchmarks/results/gpu-2026-12-06/setup.sh
(MAX_JOBS=4 python3 -c "import exllamav2" > $R/build2.log 2>&1; stamp built_exl2 $?) &
b2=$!
(MAX_JOBS=14 python3 -c "import exllamav3" > $R/build3.log 2>&1; stamp built_exl3 $?) &
b3=$!
python3 benchmarks/cost_growth.py $W --shape 8b --make > $R/make.log 2>&1
stamp made $? "$(du -sh $W/llama-8b | cut -f1)"
python3 benchmarks/cost_growth.py $W --shape 8b --label awqct -- --awqct --calibration builtin:mix > $R/awq.log 2>&1 &
a=$!
wait $b2
python3 benchmarks/cost_growth.py $W --shape 8b --label exl2 -- --exl2 4.0 > $R/exl2.log 2>&1 &
e2=$!
(while kill -0 $e2 2>/dev/null; do
     m=$(find $W/home-8b -name measurement.json 2>/dev/null | head -1)
     [ -n "$m" ] && { cp "$m" $R/measurement-8b.json; stamp measured; break; }
     sleep 10
 done) &
wait $b3
python3 benchmarks/cost_growth.py $W --shape 8b --label exl3 -- --exl3 4.0 > $R/exl3.log 2>&1 &
e3=$!
wait $a; stamp awqct_job $?
wait $e2; stamp exl2_job $?
wait $e3; stamp exl3_job $?
cp benchmarks/results/cost_growth.json $R/ 2>/dev/null
stamp done
