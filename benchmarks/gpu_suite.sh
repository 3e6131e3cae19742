#!/usr/bin/env bash
# The GPU runs, on the H200 device machine, after MLX's CUDA build is installed
# (../shared/device/mlx-cuda/README.md). Results go to $OUT (or /tmp/mlxs-out).
#   bash benchmarks/gpu_suite.sh warmup     compile the CUDA suite's kernels (its session fixture,
#                                           alone: a fresh machine's first call; 508 s on an
#                                           empty cache, 2026-12-02h)
#   bash benchmarks/gpu_suite.sh warmup1    its first part (tiny-mixtral, thresholds-qwen3_moe:
#                                           265 s of the 508) in a call of its own, before warmup
#   bash benchmarks/gpu_suite.sh isolate    each device-path case, then host-tiny-mixtral, in a
#                                           process of their own (CUDA_LAUNCH_BLOCKING=1, each
#                                           under LIMIT): which case leaves a sticky CUDA
#                                           error (2026-12-03b: the suite's later cases failed
#                                           on "an illegal memory access")
#   bash benchmarks/gpu_suite.sh tests      the cuda-marked tests (every CUDA path's exactness,
#                                           the plan kernel against its reference, verify, /health);
#                                           K selects some (pytest -k), MLXS_WARMUP_ONLY the
#                                           presets the session fixture compiles for. After
#                                           warmup on the same machine and tree the fixture
#                                           skips its replay (a mark in MLX_PTX_CACHE_DIR;
#                                           before 2026-12-07g it cost 120-176 s a run, 1.3 s
#                                           after it, 2026-12-07h). Without
#                                           a seeded kernel cache run warmup1 first: tests with
#                                           MLXS_WARMUP_ONLY=tiny-mixtral timed out in the
#                                           fixture at 290 s (2026-12-06c); the whole suite on
#                                           a half-filled cache took 495 s (338 in the fixture)
#   bash benchmarks/gpu_suite.sh speed      DeepSeek-V2-Lite shape at full width, its real routing:
#                                           stock and streamed alternating at 50/25/12.5%,
#                                           warm page cache, 32-token prompt, 96 decode tokens;
#                                           prefill of 2048 tokens at 25%
#   bash benchmarks/gpu_suite.sh pairs      the same decode in nine pairs of 32 tokens per residency
#                                           (three of 96 in speed): stock moved 58-126 tok/s
#                                           between runs of one call (2026-12-04f), so shorter
#                                           pairs drift less within each and give more of them
#                                           (each prompt's fixed cost, the tables sent back to
#                                           the device, weighs 3x more: compare pairs with pairs)
#   bash benchmarks/gpu_suite.sh cold       the same at 50/25/12.5% with a cold page cache
#   bash benchmarks/gpu_suite.sh compare    50% and 25% warm: the Python reader, overlap on, and
#                                           the LRU policy, beside the default
#   bash benchmarks/gpu_suite.sh prefill    a 2048-token prompt at 25% against stock (and a short
#                                           decode at 25%)
#   bash benchmarks/gpu_suite.sh parity     every expert resident against stock, 15 alternating pairs
#   bash benchmarks/gpu_suite.sh layers     decode at 50% with FULL (default "4 6 8") layers whole and
#                                           the rest streamed at equal slots, then uniform
#                                           (probes/resident_layers.py writes the profiles)
#   bash benchmarks/gpu_suite.sh readprobe  the native reader's time for 1-4 records by threads and
#                                           piece size, alone and beside device work
#   bash benchmarks/gpu_suite.sh diskprobe  the same from the disk (O_DIRECT), 1-8 records, up to 63
#                                           threads: one record's wait against the disk's bandwidth
#   bash benchmarks/gpu_suite.sh mailbox    a kernel's request to the host and its answer through mapped
#                                           page-locked memory, no CUDA call answering
#                                           (probes/mapped_mailbox.py): the round trip, and
#                                           whether it holds while MLX compiles, allocates, syncs
#   bash benchmarks/gpu_suite.sh ring       records a kernel asks the engine's request ring for (probes/ring_read.py),
#                                           page cache then O_DIRECT, against the host path's read of
#                                           the same; then one call a layer inside a graph (NUMLAYERS;
#                                           READERS ring threads, each cut of PIECES, e.g. "1 8")
#   bash benchmarks/gpu_suite.sh syncfloor  the host path's floor (probes/sync_floor.py): stock, stock launching
#                                           each layer's routing apart, and reading it on the host,
#                                           every expert resident, and the host path at RESIDENCY
#                                           (0.25; with and without the shared experts launched apart)
#   bash benchmarks/gpu_suite.sh opcount    ops and evaluation calls per decoded token, stock against
#                                           streamed at RESIDENCY (probes/graph_ops.py; TIERGB, DIRECT)
#   bash benchmarks/gpu_suite.sh mapab      decode at 50% and 25%: records read with pread into
#                                           staging, then from page-locked file mappings (default)
#   bash benchmarks/gpu_suite.sh final      decode at 50% and 25%, defaults, with a timeline
#   bash benchmarks/gpu_suite.sh graphops   decode at 50% with MLX's CUDA graphs cut at 25 and 50
#                                           ops (MLX_MAX_OPS_PER_BUFFER; 100 by default on an H200)
#   bash benchmarks/gpu_suite.sh lruab      decode at 50% and 25% under lru (beside mapab's default)
#   bash benchmarks/gpu_suite.sh devreads   decode at 50/25/12.5%: misses copied by the GPU itself
#                                           (device_reads, the default), then the host path
#   bash benchmarks/gpu_suite.sh beyond     larger than RAM: stock, then RESIDENCY (default
#                                           50/25/12.5%) cold with O_DIRECT and within a
#                                           MEMLIMIT-GB cgroup (default 10), or METHOD (direct,
#                                           memlimit) alone; each row's host time split by
#                                           phase and one decode step's timeline; in the
#                                           cgroup CUDA's default takes a whole swap tier
#                                           where it fits (2026-12-05): PAGECACHE=1 adds
#                                           --no-swap-tier, the page cache's host path
#   bash benchmarks/gpu_suite.sh beyondring  a bounded tier in the MEMLIMIT-GB cgroup (default 6) at
#                                           RESIDENCY (default 0.25): the host path, then the device
#                                           path asking the request ring (--device-reads, the
#                                           default since 2026-12-07b: 1.88x the host path);
#                                           READS: another order, or one of them; CUTS (e.g.
#                                           "8x8 16x16"): each row at each ring of READERSxPIECES
#                                           (a row takes ~95 s on a seeded cache, the first one
#                                           22 s more to build the model: LIMIT=200 at least;
#                                           120 cut the first row off twice, 2026-12-07f)
#   bash benchmarks/gpu_suite.sh tierkernel  the plan kernel's bounded-tier variant against its
#                                           reference (tests/test_cuda_tier.py; no session fixture)
#   bash benchmarks/gpu_suite.sh beyondahead  larger than RAM with O_DIRECT at 50% and 25%,
#                                           read-ahead off, then by the trace's transitions
#                                           (2026-12-04g: 50% only within LIMIT=170; the
#                                           transitions' guesses, right a quarter of the
#                                           time, doubled the bytes)
#   bash benchmarks/gpu_suite.sh beyondoracle  the same at RESIDENCY (default 0.5): read-ahead
#                                           off, then by a simulated predictor right ORACLE
#                                           (default "0.7,1") of the time: whether a real
#                                           router's guesses (~70% right) pay on the disk
#                                           (METHOD=memlimit: in the MEMLIMIT-GB cgroup)
#   bash benchmarks/gpu_suite.sh beyondtier  larger than RAM in the MEMLIMIT-GB cgroup (default 6)
#                                           at RESIDENCY (default 0.5) with the swap tier
#                                           (--swap-tier): the device path trading each miss
#                                           with its victim; against the host path's 17.5 tok/s
#                                           there (2026-12-04p-cgroup50). With TIERGB, a tier
#                                           of that many GB (--swap-tier-gb), the rest read
#                                           (METHOD, default memlimit; direct: O_DIRECT;
#                                           DIRECT=1: O_DIRECT within the cgroup, DIRECT=0: the
#                                           page cache); TIERGB=auto: what memory holds
#                                           (--swap-tier-gb auto; O_DIRECT beneath it unless
#                                           DIRECT=0, the default since 2026-12-06b)
#   bash benchmarks/gpu_suite.sh beyondpair  in the MEMLIMIT-GB cgroup (default 6), at each of RESIDENCY
#                                           (default "0.25 0.125"): the default (where a whole
#                                           tier does not fit, one bounded to what memory holds,
#                                           O_DIRECT for the rest since 2026-12-06b), then the
#                                           same through the page cache (--no-direct-io): the
#                                           pair that decides O_DIRECT as the default there
#                                           (measured on the host path; since 2026-12-07b the
#                                           default's bounded tier takes the ring: ARGS=
#                                           --no-device-reads for the former pair)
#   bash benchmarks/gpu_suite.sh policies   decode at 50/25/12.5% on the device path under lru, then
#                                           the host path under predictive: miss rates per path
#   (mapab, lruab and compare measure the host path: they pass --no-device-reads)
#   bash benchmarks/gpu_suite.sh direct     copies to the device straight from the page cache (a
#                                           registered file mapping) against the staged path
#   bash benchmarks/gpu_suite.sh nsys       the device's own timeline of 16 decode steps, stock
#                                           and streamed at RESIDENCY (default 0.5), from Nsight
#                                           Systems (nsys ships with the machine's Nsight
#                                           Compute): busy/idle per step, kernels by name, the
#                                           plan kernel's µs per call (probes/gpu_timeline.py);
#                                           nsys's importer needs libdw.so.1 (with libelf,
#                                           liblzma, libbz2) in .gpu/lib, from this machine's
#                                           /usr/lib/x86_64-linux-gnu (the H200 lacks it)
#   bash benchmarks/gpu_suite.sh launch     MLX's host cost per evaluation call and per op, with and
#                                           without CUDA graphs
#   bash benchmarks/gpu_suite.sh split      one decode step's build / launch / wait, stock against
#                                           streamed at RESIDENCY (default 0.5; e.g. "0.5,0.125"):
#                                           as loaded, copies dropped, no kernel, a second empty
#                                           kernel per call, 1,024 blocks, every expert resident;
#                                           ROUNDS alternating rounds (default 5)
#   bash benchmarks/gpu_suite.sh precision  larger than RAM (O_DIRECT; METHOD=memlimit: a MEMLIMIT-GB cgroup, default 6) at RESIDENCY (0.25) by precision:
#                                           FORMATS (default "4-bit,3-bit"; see precision_beyond.py),
#                                           TOKENS decode tokens a run (32) from START (below)
#   bash benchmarks/gpu_suite.sh hostprof   cProfile of decode, stock against 50% and 25%: where the
#                                           host's time goes, MLX's eval calls shown apart
#   bash benchmarks/gpu_suite.sh hmm        whether a kernel can read a plain (unlocked) file mapping
#                                           (HMM); without it the process ends on an illegal
#                                           address (2026-12-04o: so on our H200)
#   bash benchmarks/gpu_suite.sh streams    a swap copy's rate by block count, and whether a second
#                                           MLX stream runs it beside compute (a read-ahead's room)
#   bash benchmarks/gpu_suite.sh kernelcost  the host's cost of a custom-kernel call by source size
#                                           and template arguments (the plan kernel's shape)
#   bash benchmarks/gpu_suite.sh stall      the probe of why the removed kernel transport stalled
#   bash benchmarks/gpu_suite.sh oracle     50%: read-ahead by the trace's transitions and by a
#                                           simulated predictor right 0/50/70/90/100% of the time
#   bash benchmarks/gpu_suite.sh exact      where streaming stops being bit-exact, per preset
#   bash benchmarks/gpu_suite.sh gated      a bounded tier's reads beside its trades against after
#                                           them, on the host path (probes/gated_read.py;
#                                           DIRECT=1: from the disk)
#   bash benchmarks/gpu_suite.sh probe      the primitives and the host-time profile
#   bash benchmarks/gpu_suite.sh nan        where stock Qwen3-Next first gives a non-finite value
#   bash benchmarks/gpu_suite.sh train      train-tiny at the committed model's shape: a timed
#                                           probe sizes the run to TRAIN_S seconds (default 240)
#                                           unless TRAIN_STEPS is given;
#                                           then the quality table against the float model
#                                           (QUALITY=0 leaves it to a later `quality` suite).
#                                           The checkpoint comes back as trained.tgz.part-*.
#                                           Text: .gpu/corpus.tar.xz when present (the .py
#                                           files of this machine's standard library, tests
#                                           included: 1,790 files, 4.7 MB; in STDLIB,
#                                           find . -name '*.py' -not -path './site-packages/*'
#                                           | sort | tar cJf corpus.tar.xz -T -), else
#                                           SOURCES (default stdlib: 574 files there).
#                                           CORPUS names another carried corpus, e.g.
#                                           .gpu/corpus-site.tar.xz: the same standard
#                                           library plus the .py files of numpy, pip,
#                                           setuptools, huggingface_hub, mlx_lm,
#                                           hypothesis and jinja2 from this machine's
#                                           venv (3,408 files, 55.5 MB, 8.5 MB as xz)
# Several suites may run in one call; at exit (a timeout included) every result file is
# bundled into $OUT/results.tgz (the device returns few files), beside ptx.tgz and the
# trained checkpoint's parts. ARGS adds flags to every speed.py row (e.g. ARGS="--threads 31").
# START starts the speed.py and precision rows' routing at that trace token (default: the
# held-out half's first, 44928). That first stretch is among the trace's cheapest: the
# simulator puts the 7h rows there at 0.29-0.62 of the held-out routing's typical disk
# bytes (2026-12-08). START=64928 and 82928 fall within 10% of typical for the ring rows'
# shape and both precision rows' (probes/stretches.py; results/stretches-*-2026-12-08.json);
# each row's stretch_vs_typical says where its own stretch falls. Their files are named
# -sSTART, so one call may run several starts (START=64928 ...; START=82928 ...).
# TRACE names the DeepSeek-V2-Lite trace
# (default .gpu/deepseek-v2-lite.npz, copied from ../shared/traces). MLX compiles each
# kernel variant on first use; .gpu/ptx.tgz (a former run's $OUT/ptx.tgz) seeds its cache,
# .gpu/nv.tgz.part-* (its $OUT/nv.tgz.part-*, where they fit) the driver's. Neither fits
# beside .mlxcuda2 and the trace: carry ptx.tgz with .mlxcuda1b and the nv parts in a call
# of their own (gpu_stage.sh), each call copying them to /tmp (/tmp/ptx-seed.tgz,
# /tmp/nv.tgz.part-*), where this script finds them. With ptx.tgz seeded, `warmup` took
# 106 s and `tests` then 209 s on a fresh H100 (2026-12-06d); with both seeds, 148 s and
# then 175 s for the whole suite in one process, its fixture skipped (2026-12-07h).
# A call carries at most 64 MiB with the repository (22 MiB with its trained checkpoint):
# the MLX CUDA wheel travels in three parts (2026-12-07f): .mlxcuda1 and .mlxcuda1b (32 MiB
# each, parked in /tmp by their stage1.sh), then .mlxcuda2 (22 MiB, with .gpu's 9 MiB
# trace beside it) whose stage2.sh installs; three calls within 30 s of each other
# (`bash benchmarks/gpu_stage.sh` makes all of it in a fresh checkout). Build
# the compiled extensions in the same call (`python3 setup.py -q build_ext --inplace`).
set -u
# the package from this tree (its extensions built in place), for scripts and subprocesses
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
out=${OUT:-/tmp/mlxs-out}
mkdir -p "$out"
work=/tmp/mlxs
trace=${TRACE:-.gpu/deepseek-v2-lite.npz}
limit=${LIMIT:-540}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
export MLX_PTX_CACHE_DIR=/tmp/mlxs-ptx
# MLX caches PTX; the driver compiles it to machine code in every new process unless its
# own cache is kept too (2026-12-06b: a fresh machine seeded with all 79 PTX files still
# spent ~195 s in the suite's fixture): it travels in the same bundle
export CUDA_CACHE_PATH=$MLX_PTX_CACHE_DIR/nv CUDA_CACHE_MAXSIZE=2147483648
for seed in .gpu/ptx.tgz .gpuseed/ptx.tgz /tmp/ptx-seed.tgz; do  # an empty cache: minutes
  [ -f $seed ] && [ -z "$(ls -A $MLX_PTX_CACHE_DIR 2>/dev/null)" ] && mkdir -p $MLX_PTX_CACHE_DIR \
    && tar xzf $seed -C $MLX_PTX_CACHE_DIR --strip-components=1
done
for parts in .gpu /tmp; do  # the driver's cache, in parts (a former run's $OUT/nv.tgz.part-*)
  ls $parts/nv.tgz.part-* > /dev/null 2>&1 && [ ! -d $CUDA_CACHE_PATH ] && mkdir -p $CUDA_CACHE_PATH \
    && cat $parts/nv.tgz.part-* | tar xz -C $MLX_PTX_CACHE_DIR
done
bundle() {  # the device returns only a few files per call: the results go back as one
  # files come back at 16 MiB each, 8 a call: MLX's cache in one, the driver's in parts
  tar czf "$out/ptx.tgz" -C /tmp --exclude mlxs-ptx/nv --exclude 'mlxs-warmup-*' mlxs-ptx 2>/dev/null
  du -sk $CUDA_CACHE_PATH $MLX_PTX_CACHE_DIR > "$out/cache-kb.txt" 2>&1
  rm -f "$out"/nv.tgz.part-*
  [ -d $CUDA_CACHE_PATH ] && tar czf /tmp/nv.tgz -C $MLX_PTX_CACHE_DIR nv \
    && [ "$(stat -c %s /tmp/nv.tgz)" -le $((45 * 1024 * 1024)) ] \
    && split -b 15m /tmp/nv.tgz "$out/nv.tgz.part-"
  local files
  files=$(cd "$out" && ls -p | grep -v -e '^ptx.tgz$' -e '^results.*\.tgz$' -e '^trained.tgz.part-' \
    -e '^nv.tgz.part-' -e '/$')
  local name=results.tgz n=1  # a later invocation in the same call keeps the earlier bundle
  while [ -e "$out/$name" ]; do n=$((n + 1)); name=results-$n.tgz; done
  [ -n "$files" ] && (cd "$out" && tar czf $name $files && rm -f $files)
}
trap bundle EXIT
speed() {  # name, args... (START in the name: one call may run several starts)
  local name=$1${START:+-s$START}; shift
  timeout "$limit" python3 benchmarks/speed.py --workdir $work --preset dsv2-lite \
    --trace "$trace" ${START:+--trace-start $START} --tokens 96 --prompt-tokens 32 \
    --json "$out/speed-$name.json" "$@" ${ARGS:-} 2>&1 \
    | grep -v "PyTorch was not found" | tee "$out/speed-$name.log" | grep -v "^{" | tail -5
}
quality() {  # the quality table of the float model that train left in /tmp/tiny-float
  rm -rf /tmp/tq; timeout 300 python3 benchmarks/trained_quality.py --model /tmp/tiny-float \
    --workdir /tmp/tq --json "$out/quality-trained.json" 2>&1 | tail -3
}
# RESIDENCY as commas for every suite that takes a list (spaces once worked for some only);
# the nsys suite, whose script takes one residency, still takes one
[ -z "${RESIDENCY:-}" ] || RESIDENCY=$(echo "$RESIDENCY" | tr -s ", " ",,")
for suite in "$@"; do
case "$suite" in
  warmup1) MLXS_WARMUP_ONLY=tiny-mixtral,thresholds-qwen3_moe timeout "$limit" python3 -m pytest \
            -v -s --durations=0 -m cuda tests/test_cuda.py -k test_kernels_compiled 2>&1 \
            | tee "$out/warmup1-cuda.log" | tail -8 ;;
  warmup) timeout "$limit" python3 -m pytest -v -s --durations=0 -m cuda tests/test_cuda.py \
            -k test_kernels_compiled 2>&1 | tee "$out/warmup-cuda.log" | tail -8 ;;
  isolate) for preset in tiny-mixtral thresholds-qwen3_moe tiny-qwen3_next; do
            MLXS_WARMUP_ONLY=$preset,tiny-mixtral CUDA_LAUNCH_BLOCKING=1 timeout "$limit" \
              python3 -m pytest -x -v -m cuda tests/test_cuda.py \
              -k "device-$preset or host-tiny-mixtral" > "$out/isolate-$preset.log" 2>&1
            echo "device-$preset then host-tiny-mixtral: rc $? $(tail -1 "$out/isolate-$preset.log")"
          done ;;
  tests) timeout "$limit" python3 -m pytest -v --durations=0 -m cuda tests/test_cuda.py ${K:+-k "$K"} 2>&1 \
           | tee "$out/tests-cuda.log" | tail -15 ;;
  streams) timeout "$limit" python3 benchmarks/probes/stream_overlap.py \
             --json "$out/stream-overlap.json" 2>&1 | tee "$out/stream-overlap.log" | tail -6 ;;
  quick) speed gpu-dsv2-quick --residency 0.5 --cold warm --repeat 3 --prefill-tokens 0 \
           --timeline "$out/timeline-gpu-dsv2-quick.json" ;;
  mapab) speed gpu-dsv2-pread --residency 0.5,0.25 --cold warm --repeat 3 --prefill-tokens 0 \
           --no-map-files
         speed gpu-dsv2-mapped --residency 0.5,0.25 --cold warm --repeat 3 --prefill-tokens 0 \
           --no-device-reads --timeline "$out/timeline-gpu-dsv2-mapped.json" ;;
  final) speed gpu-dsv2-final --residency 0.5,0.25 --cold warm --repeat 3 --prefill-tokens 0 \
           --timeline "$out/timeline-gpu-dsv2-final.json" ;;
  beyond) speed gpu-dsv2-beyond --residency "${RESIDENCY:-0.5,0.25,0.125}" --repeat 3 \
            --beyond-ram "${METHOD:-both}" --memory-limit-gb "${MEMLIMIT:-10}" \
            $([ "${PAGECACHE:-}" = 1 ] && echo --no-swap-tier) --timeline "$out/timeline-beyond.json" ;;
  beyondtier) speed gpu-dsv2-beyond-tier${TIERGB:+-$TIERGB}${DIRECT:+-direct$DIRECT} \
                --residency "${RESIDENCY:-0.5}" --repeat 3 --beyond-ram "${METHOD:-memlimit}" \
                --memory-limit-gb "${MEMLIMIT:-6}" --swap-tier ${TIERGB:+--swap-tier-gb $TIERGB} \
                $([ "${DIRECT:-}" = 1 ] && echo --direct-io) $([ "${DIRECT:-}" = 0 ] && echo --no-direct-io) \
                --timeline "$out/timeline-beyond-tier.json" ;;
  beyondpair) for r in $(echo "${RESIDENCY:-0.25,0.125}" | tr , " "); do  # one machine, one call: the pair
                speed gpu-dsv2-pair-$r-default --residency "$r" --repeat 3 --beyond-ram memlimit \
                  --memory-limit-gb "${MEMLIMIT:-6}" --timeline "$out/timeline-pair-$r-default.json"
                speed gpu-dsv2-pair-$r-buffered --residency "$r" --repeat 3 --beyond-ram memlimit \
                  --memory-limit-gb "${MEMLIMIT:-6}" --no-direct-io \
                  --timeline "$out/timeline-pair-$r-buffered.json"
              done ;;
  beyondring) for r in $(echo "${RESIDENCY:-0.25}" | tr , " "); do  # a bounded tier: the host path, then the device
                for reads in ${READS:---no-device-reads --device-reads}; do  # path asking the ring
                  for cut in ${CUTS:-default}; do  # the ring's threads x its cut of a record
                    tag=$r-${reads#--}${CUTS:+-cut$cut}
                    speed gpu-dsv2-ring-$tag --residency "$r" --repeat 3 --beyond-ram memlimit \
                      --memory-limit-gb "${MEMLIMIT:-6}" $reads --timeline "$out/timeline-ring-$tag${START:+-s$START}.json" \
                      ${CUTS:+--ring-readers ${cut%x*} --ring-pieces ${cut#*x}}
                  done
                done
              done ;;
  tierkernel) timeout "$limit" python3 -m pytest -v -m cuda tests/test_cuda_tier.py 2>&1 \
                | tee "$out/tier-kernel.log" | tail -15 ;;
  beyondahead) for ahead in "" --prefetch; do  # larger than RAM (O_DIRECT): read-ahead off, on
                speed gpu-dsv2-beyond${ahead:+-ahead} --residency 0.5,0.25 --repeat 3 \
                  --beyond-ram direct $ahead
              done ;;
  beyondoracle) speed gpu-dsv2-beyond-oracle --residency "${RESIDENCY:-0.5}" --repeat 3 \
                  --beyond-ram "${METHOD:-direct}" --memory-limit-gb "${MEMLIMIT:-10}" \
                  --oracle "${ORACLE:-0.7,1}" --timeline "$out/timeline-beyond-oracle.json" ;;
  policies) speed gpu-dsv2-lru --residency 0.5,0.25,0.125 --cold warm --repeat 3 \
              --prefill-tokens 0 --policy lru
            speed gpu-dsv2-hostpath --residency 0.5,0.25,0.125 --cold warm --repeat 3 \
              --prefill-tokens 0 --no-device-reads ;;
  graphops) for n in 25 50; do
              MLX_MAX_OPS_PER_BUFFER=$n speed gpu-dsv2-ops$n --residency 0.5 --cold warm --repeat 3 \
                --prefill-tokens 0
            done ;;
  devreads) speed gpu-dsv2-devreads --residency 0.5,0.25,0.125 --cold warm --repeat 3 \
              --prefill-tokens 0 --device-reads --timeline "$out/timeline-gpu-dsv2-devreads.json"
            speed gpu-dsv2-hostpath --residency 0.5,0.25,0.125 --cold warm --repeat 3 \
              --prefill-tokens 0 --no-device-reads ;;
  lruab) speed gpu-dsv2-lru --residency 0.5,0.25 --cold warm --repeat 3 --prefill-tokens 0 \
           --policy lru --no-device-reads ;;
  readprobe) timeout 200 python3 benchmarks/probes/native_read.py --workdir $work \
               --json "$out/native-read.json" 2>&1 | tee "$out/native-read.log" | tail -3 ;;
  diskprobe) timeout 200 python3 benchmarks/probes/native_read.py --workdir $work --direct \
               --repeat 11 --json "$out/native-read-direct.json" 2>&1 \
               | tee "$out/native-read-direct.log" | tail -3 ;;
  direct) timeout 200 python3 benchmarks/probes/direct_read.py --workdir $work \
            --json "$out/direct-read.json" 2>&1 | tee "$out/direct-read.log" | tail -3 ;;
  speed) speed gpu-dsv2 --residency 0.5,0.25,0.125 --cold warm --repeat 3 \
           --prefill-tokens 2048 --prefill-residency 0.25 --prefill-chunk 2048 \
           --timeline "$out/timeline-gpu-dsv2.json" ;;
  pairs) speed gpu-dsv2-pairs --residency 0.5,0.25,0.125 --cold warm --repeat 9 --tokens 32 \
          --prefill-tokens 0 ;;
  prefill) speed gpu-dsv2-prefill --residency 0.25 --cold warm --repeat 2 --tokens 16 \
             --prefill-tokens 2048 --prefill-residency 0.25 --prefill-chunk 2048 ;;
  parity) speed gpu-dsv2-parity --residency 1 --repeat 15 --prefill-tokens 0 ;;
  layers) full=${FULL:-4 6 8}
          python3 benchmarks/probes/resident_layers.py --trace "$trace" --full "0,${full// /,}" \
            --out /tmp/mlxs-layers --json "$out/resident-layers.json" 2>&1 | tail -1
          for f in $full 0; do  # 0: the uniform default, last (its profile: none)
            prof=/tmp/mlxs-layers/layers-$f.json; [ "$f" = 0 ] && prof=none
            speed gpu-dsv2-layers-$f --residency 0.5 --cold warm --repeat 5 --prefill-tokens 0 \
              --pool-profile "$prof"
          done ;;
  oracle) speed gpu-dsv2-oracle --residency 0.5 --cold warm --repeat 3 --tokens 64 \
            --prefill-tokens 0 --oracle 0,0.5,0.7,0.9,1 ;;
  exact) for p in tiny-mixtral thresholds-qwen3_moe tiny-qwen3_next; do
           timeout 240 python3 benchmarks/probes/cuda_exact.py $p 2>&1 | tee -a "$out/exact.log" \
             | tail -7
         done ;;
  mailbox) timeout 120 python3 benchmarks/probes/mapped_mailbox.py --json "$out/mapped-mailbox.json" 2>&1 \
             | tee "$out/mapped-mailbox.log" | grep -v "^ " | tail -12 ;;
  ring) for d in "" --direct; do
          timeout "$limit" python3 benchmarks/probes/ring_read.py --workdir $work $d \
            ${NUMLAYERS:+--num-layers $NUMLAYERS} ${READERS:+--readers $READERS} \
            ${PIECES:+--pieces ${PIECES// /,}} --json "$out/ring-read$d.json" 2>&1 \
            | tee "$out/ring-read$d.log" | grep -v "^ " | tail -8
        done ;;
  stall) timeout 120 python3 benchmarks/probes/gpu_wait_stall.py 2>&1 | tee "$out/stall.log" | tail -3 ;;
  cold) speed gpu-dsv2-cold --residency 0.5,0.25,0.125 --cold cold --repeat 3 \
          --prefill-tokens 0 ;;
  compare) speed gpu-dsv2-overlap --residency 0.5 --cold warm --repeat 3 \
             --prefill-tokens 0 --overlap --no-device-reads
           speed gpu-dsv2-lru --residency 0.5,0.25 --cold warm --repeat 3 \
             --prefill-tokens 0 --policy lru --no-device-reads ;;
  nan) for level in layer block; do
         timeout 200 python3 benchmarks/probes/cuda_nan.py tiny-qwen3_next --level $level 2>&1 \
           | tee -a "$out/nan.log" | tail -20
       done ;;
  train) sources=${SOURCES:-stdlib}
         corpus=${CORPUS:-.gpu/corpus.tar.xz}
         if [ -f "$corpus" ]; then  # a carried corpus (see the header)
           mkdir -p /tmp/corpus && tar xJf "$corpus" -C /tmp/corpus && sources=/tmp/corpus
         fi
         shape="--layers 8 --hidden 256 --experts 64 --top-k 6 --moe-inter 64 --vocab 4096
           --seq 256 --batch 64 --max-chars 80000000 --lr 2e-3 --aux-weight ${AUX:-0.03}
           --sources $sources"
         steps=${TRAIN_STEPS:-}
         if [ -z "$steps" ]; then  # the probe's rate includes compiling: a lower bound
           timeout 200 python3 -m mlx_streaming train-tiny --out /tmp/train-probe $shape \
             --max-chars 2000000 --steps 12 --json /tmp/train-probe.json > /dev/null 2>&1
           steps=$(python3 -c "import json; r=json.load(open('/tmp/train-probe.json'));
print(int(${TRAIN_S:-240} * r['curve'][-1]['tokens_per_s'] / (64 * 256)))")
         fi
         echo "training $steps steps"
         timeout 500 python3 -m mlx_streaming train-tiny --out /tmp/tiny-stdlib-moe $shape \
           --steps "$steps" --float-out /tmp/tiny-float 2>&1 | tee "$out/train.log" | tail -4
         tar czf - -C /tmp tiny-stdlib-moe | split -b 15m - "$out/trained.tgz.part-"
         [ "${QUALITY:-1}" = 1 ] && quality ;;
  quality) quality ;;
  nsys) nsys=${NSYS:-$(command -v nsys || ls -r /opt/nvidia/nsight-systems/*/bin/nsys \
          /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1)}
        if [ ! -x "$nsys" ]; then echo "nsys not found: set NSYS=/path/to/nsys"; continue; fi
        for mode in stock streamed; do  # one process each, the capture range its decode steps
          rm -f /tmp/nsys-$mode.nsys-rep /tmp/nsys-$mode.sqlite /tmp/nsys-${mode}_*.csv
          # its importer (QdstrmImporter) needs libdw, which the machine lacks: .gpu/lib
          LD_LIBRARY_PATH=$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
          timeout "$limit" "$nsys" profile -t cuda --cuda-graph-trace=node -f true \
            --capture-range=cudaProfilerApi --capture-range-end=stop -o /tmp/nsys-$mode \
            python3 benchmarks/probes/gpu_timeline.py --workdir $work --trace "$trace" \
            --mode $mode --residency "${RESIDENCY:-0.5}" --tokens 16 2>&1 | tail -3
          "$nsys" stats -r cuda_gpu_trace,cuda_api_sum -f csv --force-export=true \
            -o /tmp/nsys-$mode /tmp/nsys-$mode.nsys-rep 2>&1 | grep -iE "error|fail" | head -3
          [ -s /tmp/nsys-${mode}_cuda_gpu_trace.csv ] && gzip -c /tmp/nsys-${mode}_cuda_gpu_trace.csv \
            > "$out/nsys-$mode-gpu-trace.csv.gz"
        done
        python3 benchmarks/probes/gpu_timeline.py --report /tmp/nsys-stock /tmp/nsys-streamed \
          --tokens 16 --residency "${RESIDENCY:-0.5}" --json "$out/gpu-timeline.json" 2>&1 \
          | grep -E "^(stock|streamed) |Error|Traceback" ;;
  launch) for g in 1 0; do
            MLX_USE_CUDA_GRAPHS=$g timeout 200 python3 benchmarks/probes/mlx_launch.py \
              --json "$out/mlx-launch-graphs$g.json" 2>&1 | tail -8
          done ;;
  split) for r in $(echo "${RESIDENCY:-0.5}" | tr , " "); do
           timeout "$limit" python3 benchmarks/probes/decode_split.py --workdir $work \
             --trace "$trace" --residency $r --rounds "${ROUNDS:-5}" \
             --json "$out/decode-split-$r.json" 2>&1 \
             | grep -v "PyTorch was not found" | tee "$out/decode-split-$r.log" | grep -E "^(stock|streamed)"
         done ;;
  precision) timeout "$limit" python3 benchmarks/precision_beyond.py --preset dsv2-lite \
               --workdir $work --trace "$trace" ${START:+--trace-start $START} \
               --residency "${RESIDENCY:-0.25}" --tokens "${TOKENS:-32}" --repeat 3 \
               --formats "${FORMATS:-4-bit,3-bit}" --method "${METHOD:-direct}" \
               $([ "${METHOD:-direct}" = memlimit ] && echo --memory-limit-gb "${MEMLIMIT:-6}") --json "$out/precision-beyond-gpu${START:+-s$START}.json" 2>&1 \
               | grep -v "PyTorch was not found" | tee "$out/precision-beyond-gpu${START:+-s$START}.log" | tail -4 ;;
  hostprof) timeout "$limit" python3 benchmarks/probes/host_profile.py --workdir $work \
              --trace "$trace" --residency "${RESIDENCY:-0.5,0.25}" ${TIERGB:+--swap-tier-gb $TIERGB} \
              $([ "${DIRECT:-}" = 1 ] && echo --direct-io) --json "$out/host-profile${TIERGB:+-tier$TIERGB}.json" 2>&1 \
              | tail -3 ;;
  syncfloor) timeout "$limit" python3 benchmarks/probes/sync_floor.py --workdir $work --trace "$trace" \
               --residency "${RESIDENCY:-0.25}" --json "$out/sync-floor.json" 2>&1 \
               | tee "$out/sync-floor.log" | tail -3 ;;
  opcount) timeout "$limit" python3 benchmarks/probes/graph_ops.py --preset dsv2-lite --workdir $work \
             --trace "$trace" --residency "${RESIDENCY:-0.25}" ${TIERGB:+--swap-tier-gb $TIERGB} \
             $([ "${DIRECT:-}" = 1 ] && echo --direct-io) --json "$out/graph-ops.json" 2>&1 | tee "$out/graph-ops.log" | tail -3 ;;
  gated) timeout "$limit" python3 benchmarks/probes/gated_read.py --preset dsv2-lite --workdir $work \
           $([ "${DIRECT:-}" = 1 ] && echo --direct) --json "$out/gated-read$([ "${DIRECT:-}" = 1 ] && echo -direct).json" 2>&1 | tail -3 ;;
  hmm) timeout "$limit" python3 benchmarks/probes/hmm_read.py --mb 512 \
         --json "$out/hmm-read.json" 2>&1 | tee "$out/hmm-read.log" | tail -4 ;;
  kernelcost) timeout "$limit" python3 benchmarks/probes/kernel_call_cost.py \
                --json "$out/kernel-call-cost.json" 2>&1 | grep "^{" ;;
  probe) timeout "$limit" python3 benchmarks/gpu.py --workdir $work --preset dsv2-lite \
           --trace "$trace" --probe --json "$out/gpu-probe.json" 2>&1 | tail -5 ;;
  *) echo "unknown suite $suite" >&2; exit 2 ;;
esac
done
