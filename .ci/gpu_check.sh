#!/bin/bash
# The device check (issues 11, 32 and 39), last run on an NVIDIA H200 on 2026-11-28 (figures/gpu_h200_2026-11-28.jsonl; the H100's is figures/gpu_h100_2026-11-27.jsonl).
# Not run by CI. On a GPU machine: LIMIT=seconds STAGES="tests tier tier8b attention w2 idle latency profile hf" .ci/gpu_check.sh
# Copy $OUT/results.jsonl to figures/gpu_<gpu>_<date>.jsonl, and name the GPU with every figure quoted.
#   tests      the GPU tests (graphs, flash pages, verify rows of 1 + k queries, async scheduling)
#   attention  one layer's decode attention against one read of the K/V (the read floor)
#   w2         W2 with the defaults and with async scheduling, in one run (issue 32: >= 1.15x)
#   idle       GPU idle at batch 256, all of it and between the steps' forward passes (issue 32:
#              < 5% async; idle_split), sync, async inline, from the device thread, inline twice
#              more, with the host's side
#   tier       the prefix cache's CPU tier on a multi-turn workload: no tier, its copies on their
#              own stream, on the step's stream (issue 39); tier8b: the same on Qwen3-8B's shape
#   moe        opt-in (name it in STAGES): W2 on a Qwen3-30B-A3B-shaped mixture of experts with random
#              bf16 weights (issue 36; 61 GB of weights: an 80 GB GPU, about 4 minutes)
# One device session: tests, then benchmarks, each bounded by what is left of the call's time.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); LIMIT=${LIMIT:-570}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
stage() {  # stage NAME MAXSECONDS command...
  local name=$1 max=$2; shift 2
  local t=$(left); [ $t -gt $max ] && t=$max
  if [ $t -lt 15 ]; then echo "=== $name: skipped, $(left) s left"; return; fi
  echo "=== $name (limit $t s, $(left) s left)"
  local s=$(date +%s)
  timeout $t "$@" 2>&1 | tee $OUT/$name.log | tail -${TAIL:-40}
  echo "=== $name: rc ${PIPESTATUS[0]}, $(( $(date +%s) - s )) s"
}
nvidia-smi -L
lscpu | grep -E '^Model name|^CPU\(s\)'
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name()); print(torch.ops.aten._flash_attention_forward.default._schema)"
for s in ${STAGES:-tests tier tier8b attention w2 idle latency profile hf}; do
  case $s in
    tests) TAIL=60 stage tests 200 python3 -m pytest -q -m "gpu and not slow" tests/test_gpu.py tests/test_verify_rows.py -s -p no:cacheprovider -o addopts="" ;;
    tier) stage tier 150 python3 -m minicb.bench.w2 --workload tier --json $OUT/results.jsonl ;;
    tier8b) stage tier8b 200 python3 -m minicb.bench.w2 --workload tier --model random:qwen3-8b --json $OUT/results.jsonl ;;
    attention) stage attention 60 python3 -m minicb.bench.w2 --workload attention --json $OUT/results.jsonl ;;
    latency) stage latency 120 python3 -m minicb.bench.w2 --workload latency --json $OUT/results.jsonl ;;
    w2) stage w2 ${W2_MAX:-200} python3 -m minicb.bench.w2 --workload w2 --competitors ${W2_COMPETITORS:-defaults async eager} --json $OUT/results.jsonl ;;
    moe) stage moe ${MOE_MAX:-300} python3 -m minicb.bench.w2 --workload w2 --model random:qwen3-30b-a3b --competitors defaults --json $OUT/results.jsonl ;;
    idle) stage idle ${IDLE_MAX:-170} python3 -m minicb.bench.w2 --workload idle --host-profile $OUT/host_profile.txt --json $OUT/results.jsonl ;;
    profile) stage profile 80 python3 -m minicb.bench.w2 --workload profile --json $OUT/results.jsonl ;;
    hf) stage hf 260 python3 -m minicb.bench.w2 --workload w2 --competitors hf --json $OUT/results.jsonl ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
