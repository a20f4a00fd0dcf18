#!/bin/bash
# The 8B's second sitting (issue 44): what the first left, at once on one card, each
# (run once on an H100, 2026-12-06: sitting2/README.md; the disk filled and AWQ-CT overflowed float16, both mended
# since: run it again as it is)
# its own `qf run` in one home (benchmarks/cost_growth.py; the FP16 reference made once):
#  - `--exl2 4.0`: the EXL2 measurement (predicted 17 min) and one size, once exllamav2's extension is built; the
#    measurement.json is copied to /tmp/results as soon as it exists, so that a sitting cut short leaves it to carry;
#  - `--exl3 4.0`, once exllamav3's extension is built;
#  - `--awqct` at once (its pinned packages from .whl/awqct, no index).
# Start it as the first one was (report.sh polls it):
#   cp -a . /tmp/repo && cd /tmp/repo && setsid nohup bash benchmarks/results/gpu-2026-12-06/drive2.sh &
# carrying .whl (scripts/gpu_wheels, plus AWQ-CT's pins in .whl/awqct) and .commit. EXL2_JOBS, EXL3_JOBS: the
# extensions' build jobs (8 each; drive3.sh gives exllamav3's most of the cores).
source /tmp/repo/benchmarks/results/gpu-2026-12-06/setup.sh
(MAX_JOBS=${EXL2_JOBS:-8} python3 -c "import exllamav2" > $R/build2.log 2>&1; stamp built_exl2 $?) &
b2=$!
(MAX_JOBS=${EXL3_JOBS:-8} python3 -c "import exllamav3" > $R/build3.log 2>&1; stamp built_exl3 $?) &
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
