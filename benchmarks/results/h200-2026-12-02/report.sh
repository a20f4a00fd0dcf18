# copy what exists to $OUT
mkdir -p $OUT; cp -r /tmp/results/. $OUT/ 2>/dev/null
for d in /tmp/pt1 /tmp/pt2; do for db in $(find $d -name catalog.db 2>/dev/null); do n=$(echo $db | tr / _); cp $db $OUT/$n; done; done
cat /tmp/results/timeline.txt 2>/dev/null; tail -5 /tmp/results/pytest*.log 2>/dev/null; tail -3 /tmp/results/build*.log; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
