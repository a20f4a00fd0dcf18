# What both sittings' drivers start with (sourced from /tmp/repo): the environment, the results folder $R and the
# work folder $W, `stamp` for the timeline, the wheels into /tmp/site, the card's SM trace.
export PYTHONPATH=/tmp/repo:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext TORCH_CUDA_ARCH_LIST=9.0 \
    EXLLAMA_NO_SDPA=1 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH \
    PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/repo/.whl/awqct QF_COMMIT=$(cat /tmp/repo/.commit 2>/dev/null)
# extensions an earlier sitting built (ext_back.sh), carried gzipped as .ext/*.so.gz (a call carries 64 MiB in all):
# unpacked to /tmp/ext and imported from there as they are, not built again
if [ -d /tmp/repo/.ext ]; then
    mkdir -p /tmp/ext
    for gz in /tmp/repo/.ext/*.so.gz; do
        python3 -c "import gzip, shutil, sys; shutil.copyfileobj(gzip.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
            "$gz" /tmp/ext/$(basename "$gz" .gz)
    done
    export PYTHONPATH=/tmp/ext:$PYTHONPATH
fi
R=/tmp/results W=/tmp/w; mkdir -p $R $W
cd /tmp/repo
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) $*" >> $R/timeline.txt; }
stamp start "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)" "$(nproc) cores" \
    "$(free -g | awk '/Mem/{print $2}') GiB" "$(df -h /tmp | awk 'NR==2{print $4}') free"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/exl3/*.whl \
    > $R/pip.log 2>&1
stamp wheels $?
nvidia-smi dmon -s um -d 2 > $R/dmon.txt 2>&1 &
