#!/bin/bash
# Issue 44's fifth sitting, prepared 2026-12-06 (not run yet): what sitting 4 left (drive4b.sh ran out of device
# time): the EXL3 unit at the 1.1B and 3B shapes, the 3B's EXL2 size and AutoAWQ job whole, and both extensions
# built, for ext_back.sh to return (a sixth sitting then carries them as .ext/ and has its time for the 8B's EXL3,
# about 18 minutes). Expected from the cost model: EXL3 4.0 at 3B about 456 s, at 1.1B about 173 s; the builds
# 171 s (exllamav2) and about 450 s (exllamav3); the sitting about 17 minutes.
# Start (carry .whl and .commit; poll report.sh back to back: a machine goes back 30 s after a call ends):
#   rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -a . /tmp/repo/ && cd /tmp/repo &&
#   (setsid nohup bash benchmarks/results/gpu-2026-12-06/drive5.sh > /tmp/drive.log 2>&1 < /dev/null &)
# then, once the timeline says done: bash benchmarks/results/gpu-2026-12-06/ext_back.sh
source /tmp/repo/benchmarks/results/gpu-2026-12-06/setup.sh
(MAX_JOBS=8 python3 -c "import exllamav2" > $R/build2.log 2>&1; stamp built_exl2 $?) &
b2=$!
(MAX_JOBS=8 python3 -c "import exllamav3" > $R/build3.log 2>&1; stamp built_exl3 $?) &
b3=$!
python3 benchmarks/cost_growth.py $W --shape 3b --make > $R/make.log 2>&1
stamp made_3b $? "$(du -sh $W/llama-3b | cut -f1)"
python3 benchmarks/cost_growth.py $W --shape 1.1b --make >> $R/make.log 2>&1
stamp made_1.1b $?
job() {  # SHAPE LABEL QF_ARGS...: one qf run, stamped when it ends
    local shape=$1 label=$2; shift 2
    python3 benchmarks/cost_growth.py $W --shape $shape --label $label -- "$@" > $R/$shape-$label.log 2>&1
    stamp "${shape}_$label" $?
}
job 3b awq --awq &
wait $b2
job 3b exl2 --exl2 4.0 &
wait $b3
job 3b exl3 --exl3 4.0 &
job 1.1b exl3 --exl3 4.0 &
wait
cp benchmarks/results/cost_growth.json $R/ 2>/dev/null
stamp done
