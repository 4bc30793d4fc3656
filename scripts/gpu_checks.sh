#!/usr/bin/env bash
# The checks that need a GPU (issues #16 and #20), as one command for a lent GPU machine: one
# H100 or H200, no network, a python3 (3.12) that holds torch, transformers and peft, but none
# of fastapi, pydantic, uvicorn, the tinker SDK or megatron-core. Those travel as wheels.
#
#   bash scripts/gpu_checks.sh wheels   here: the missing packages for Python 3.12 into .whl/
#                                       (28 wheels, about 22 MB; .whl/ is git-ignored)
#   bash scripts/gpu_checks.sh run [SECTION...]
#                                       there (the device tool: carry .whl, timeout_s 590): results
#                                       under $OUT (default ./gpu-checks): summary.txt, the JSON
#                                       and the logs in logs.tar.gz. All sections
#                                       take longer than one call may: run them in two,
#                                       `run gpu-tests model megatron-tp` and `run model
#                                       activation-memory profile train-efficiency
#                                       train-efficiency-mixed lora-compute` (on an H200 on
#                                       2026-11-26: tests ~230 s cold, model 39 s to write and
#                                       13 s once written, megatron-tp 57, activation-memory 35,
#                                       profile 34, train-efficiency 24, mixed 49; the start
#                                       half a minute)
#   GPU_CHECKS_SMALL=1 bash scripts/gpu_checks.sh run
#                                       anywhere, on the CPU: the same steps on tiny shapes, to
#                                       check the plumbing before spending GPU time
#
# run, in order of worth, each section under its own time limit (1,480 s in all: more than one lent
# session holds; the last sections wait for the next) so that one
# slow section leaves the others their time, and each in a session of its own, ended after it:
#   1. gpu-tests: tests/e2e/test_gpu.py: peft (under each rule of activation memory; also with
#      --lora-compute base), ddp over NCCL and megatron tp=1 (also with base) on cuda:0 against
#      the CPU; bfloat16 bases with float32 LoRA; transformer-engine's layers if importable
#   2. model: Qwen3-8B's shape with random bf16 weights, written once (16 GB)
#   3. megatron-tp: benchmarks/megatron_tp.py: that model, LoRA r32, one 4K-token sequence,
#      peft against megatron tp=1, one path at a time (a failed path is recorded), MFU
#   4. activation-memory: benchmarks/activation_memory.py: that model, 4 x 4K tokens, every layer
#      recomputed against activation_memory_gib=auto (as many layers stored as fit)
#   5. profile: benchmarks/profile_step.py: one step of that model on a 4K-token sequence under
#      PyTorch's profiler: the GPU's busy time by kind of kernel, the busiest kernels
#   6. train-efficiency: benchmarks/train_efficiency.py: tenants (8 x 256 tokens: one pass
#      against one at a time) on the tiny model and Qwen3-8B's shape
#   7. train-efficiency-mixed: the same script's mixed lengths (16 sequences of 64-4096 tokens)
#      on Qwen3-8B's shape, packed against padded, in micro-batches of 4,096 tokens (the padded
#      path stores every layer: 16,384 ran an H200 out of memory)
#   8. lora-compute: benchmarks/lora_compute.py: that model, one 4K-token sequence, LoRA's
#      products in float32 against the base's bf16 (--lora-compute base); not yet run on a GPU
#   9. moe-model, moe-step: benchmarks/moe_step.py: Qwen3-30B-A3B's shape (random bf16, 12 of its
#      48 layers, written once, so that it builds and loads within a section), 4K tokens, LoRA on every
#      routed expert against attention-only LoRA, MFU on active parameters; its JSON travels in
#      logs.tar.gz (the device tool brings back 8 files); not yet run on a GPU
#  10. hybrid-model, hybrid-mixed: the mixed lengths on Qwen3.5-9B's shape cut to 8 layers (6
#      Gated-DeltaNet, 2 gated full attention; random bf16), packed (flash-linear-attention's varlen
#      kernels) against padded (transformers' own, fla too); JSON in logs.tar.gz; not yet run on a GPU
#  11. megatron-hybrid: benchmarks/megatron_tp.py on that model, one 4K-token sequence, peft against
#      megatron tp=1 (its Gated-DeltaNet layer, fla's varlen kernel through rank.linear_attention, which
#      no GPU has run on megatron), one path at a time, losses side by side; not yet run on a GPU
set -euo pipefail
cd "$(dirname "$0")/.."

# What the GPU image lacks, at the versions this project is tested with (pip's resolution of
# `.[megatron]` against that image's packages, as KINDS.md lists them on 2026-11-17).
WHEELS="tinker==0.38.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 httptools==0.9.0 websockets==17.4
  watchfiles==1.3.0 python-dotenv==1.2.4 zstandard==0.25.0 megatron-core==0.16.1 sniffio==1.3.1
  distro==1.9.0 httpx2==2.16.2 httpcore2==2.16.2 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
  opentelemetry-api==1.45.2 orjson==3.13.0 pyqwest==0.12.0 truststore==0.10.5 openai==3.57.0 jiter==0.19.0
  pyrage==1.4.0 flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.1"

wheels() {
  local platforms=() n
  for n in 17 24 27 28 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  # shellcheck disable=SC2086  # WHEELS is a list
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $WHEELS
  du -sh .whl
}

section() { # section NAME SECONDS COMMAND...: its output to $OUT/NAME.log; a failure or timeout is recorded, not fatal
  local name="$1" limit=$(($2 * ${SLOWER:-1})) rc=0 started=$SECONDS pid
  shift 2
  if [ ${#ONLY[@]} -gt 0 ] && [[ " ${ONLY[*]} " != *" $name "* ]]; then return; fi
  echo "==> $name (at most ${limit}s)"
  # A session of its own: what is left of it afterwards (workers finishing a step after timeout
  # stopped their server, say) is ended with it, before the next section needs the GPU.
  setsid timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1 &
  pid=$!
  wait "$pid" || rc=$?
  kill -KILL -- "-$pid" 2>/dev/null || true
  tail -n 25 "$OUT/$name.log"
  echo "<== $name: exit $rc after $((SECONDS - started))s" | tee -a "$OUT/summary.txt"
}

run() { # run [SECTION...]: all sections, or only those named
  ONLY=("$@")
  OUT="${OUT:-$PWD/gpu-checks}"
  mkdir -p "$OUT"
  : >"$OUT/summary.txt"
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
  else
    export PYTHONPATH="$PWD"
  fi
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  # MFU's peak: the benchmarks know the H100's and H200's dense bf16 peaks by the device's name
  local device=cuda shape=qwen3-8b dtype=bfloat16 seq=4096 seqs=4 moe_layers=12 hybrid=qwen3.5-9b-l8
  if [ -n "${GPU_CHECKS_SMALL:-}" ]; then
    device=cpu shape=qwen3-h512-l4 dtype=float32 seq=256 seqs=2 moe_layers=1 hybrid=qwen3.5-h512-l4
    SLOWER=4 # the limits are the GPU's
    export HT_TEST_GPU_DEVICE=cpu # tests/e2e/test_gpu.py's tests, run on the CPU
  else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/summary.txt"
  fi
  python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "transformers", transformers.__version__, "peft", peft.__version__)' | tee -a "$OUT/summary.txt"

  section gpu-tests 360 python3 -m pytest -q -p no:cacheprovider -rs tests/e2e/test_gpu.py \
    tests/e2e/test_megatron.py::test_transformer_engine_layers_train_as_the_local_ones
  section model 60 python3 -c "from benchmarks.shapes import random_model; print(random_model('$shape', '$dtype'))"
  section megatron-tp 100 python3 benchmarks/megatron_tp.py --device "$device" --shape "$shape" --dtype "$dtype" \
    --tp 1 --batch 1 --seq-len "$seq" --min-len "$seq" --one-at-a-time --steps 2 --rounds 2 --warmup 1 \
    --out "$OUT/megatron_tp-$device.json"
  section activation-memory 80 python3 benchmarks/activation_memory.py --device "$device" --shape "$shape" \
    --dtype "$dtype" --seqs "$seqs" --seq-len "$seq" --rounds 1 --out "$OUT/activation_memory-$device.json"
  section profile 50 python3 benchmarks/profile_step.py --device "$device" --shape "$shape" --dtype "$dtype" \
    --batch 1 --seq-len "$seq" --out "$OUT/profile_step-$device.json"
  section train-efficiency 50 python3 benchmarks/train_efficiency.py --device "$device" --dtype "$dtype" \
    --scenario tenants --tenants-shape "$shape" --rounds 2 --out "$OUT/train_efficiency-tenants-$device.json"
  section train-efficiency-mixed 60 python3 benchmarks/train_efficiency.py --device "$device" --dtype "$dtype" \
    --scenario mixed --mixed-shape "$shape" --microbatch-tokens 4096 --rounds 2 \
    --out "$OUT/train_efficiency-mixed-$device.json"
  section lora-compute 60 python3 benchmarks/lora_compute.py --device "$device" --shape "$shape" --dtype "$dtype" \
    --seqs 1 --seq-len "$seq" --out "$OUT/lora_compute-$device.json"
  section moe-model 120 python3 -c "from benchmarks.moe_step import random_moe_model; print(random_moe_model($moe_layers, '$dtype'))"
  section moe-step 120 python3 benchmarks/moe_step.py --device "$device" --dtype "$dtype" --layers "$moe_layers" \
    --tokens "$seq" --rounds 2 --out "$OUT/moe_step-$device.log.json"
  section hybrid-model 120 python3 -c "from benchmarks.shapes import random_model; print(random_model('$hybrid', '$dtype'))"
  section hybrid-mixed 150 python3 benchmarks/train_efficiency.py --device "$device" --dtype "$dtype" \
    --scenario mixed --mixed-shape "$hybrid" --microbatch-tokens 4096 --rounds 2 \
    --out "$OUT/train_efficiency-mixed-hybrid-$device.log.json"
  section megatron-hybrid 150 python3 benchmarks/megatron_tp.py --device "$device" --shape "$hybrid" \
    --dtype "$dtype" --tp 1 --batch 1 --seq-len "$seq" --min-len "$seq" --one-at-a-time --steps 2 --rounds 2 \
    --warmup 1 --out "$OUT/megatron_tp-hybrid-$device.log.json"
  # The device tool brings back at most 8 files: the logs travel as one
  (cd "$OUT" && shopt -s nullglob && tar -czf logs.tar.gz ./*.log ./*.log.json && rm -f ./*.log ./*.log.json)
  cat "$OUT/summary.txt"
}

case "${1:-}" in
  wheels) wheels ;;
  run) shift && run "$@" ;;
  *) sed -n '2,50p' "$0" && exit 2 ;;
esac
