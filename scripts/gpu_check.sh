#!/usr/bin/env bash
# The GPU check: one prepared run on one GPU (an H200 here), at most ~8 minutes (run it with timeout_s=540).
#
#   bash scripts/gpu_check.sh fetch     # on the CPU machine first: wheels the GPU image lacks -> .whl/
#   bash scripts/gpu_check.sh           # on the GPU machine (carry .whl): device info, GPU tests, 1B bench
#
# The GPU image has jax/jaxlib with the CUDA plugin, optax, orbax, pytest, but not grain, array-record,
# portpicker or tensorboardX. WHEELS holds every runtime dependency of pyproject.toml but jax, numpy and
# ml_dtypes (the image's jaxlib is built against its own: never replaced), at the versions tested here;
# on the GPU machine only those the image lacks are installed, and flax always (pinned). Wheels go into
# /tmp/site (nothing else on the machine changes); the `deps` line says which runtime dependency imports. Every result is one JSON line on stdout and,
# when $OUT is set, in $OUT/gpu_check.jsonl (the full log in $OUT/gpu_check.log).
#
# Bench: configs/1b.yaml (Llama 3.2 1B shape, seq 8192) in bfloat16 on one GPU, global_batch 2
# (16K tokens a step), with and without remat, with and without optimizer-state host offload, with
# parameters offloaded (tokens/s against the same remat without), also with XLA's pipelined host offloading;
# scripts/memory/offload_prefetch.py's copies and losses with that flag on and off.
# MFU is against the datasheet dense bf16 peak (989 TFLOP/s); target 55%.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5 flax==0.12.8
        optax==0.2.8 orbax-checkpoint==0.12.8 chex==0.1.92 pyyaml==6.0.3 tqdm==4.70.1 xxhash==4.1.0
        matplotlib==3.11.2 tokenizers==0.23.3 safetensors==0.8.0 huggingface_hub==2.4.0 jinja2==3.1.6
        markupsafe==3.0.3)

if [[ "${1:-}" == "fetch" ]]; then
  mkdir -p .whl
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
  exit $?
fi

OUT_DIR="${OUT:-}"
LOG=/dev/null
if [[ -n "$OUT_DIR" ]]; then
  LOG="$OUT_DIR/gpu_check.log"
  exec > >(tee -a "$LOG") 2>&1
fi
emit() {  # one JSON line to stdout and $OUT/gpu_check.jsonl
  echo "$1"
  [[ -n "$OUT_DIR" ]] && echo "$1" >> "$OUT_DIR/gpu_check.jsonl"
  return 0
}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

if compgen -G ".whl/*.whl" > /dev/null; then
  mapfile -t NEED < <(python3 - <<'EOF'
import glob, importlib.metadata as md, os
for wheel in sorted(glob.glob(".whl/*.whl")):
    name = os.path.basename(wheel).split("-")[0]
    try:
        md.version(name)
        if name.lower() != "flax":
            continue  # the image has it
    except md.PackageNotFoundError:
        pass
    print(wheel)
EOF
)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${NEED[@]}" \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95  # the bench is alone on the GPU
export PYTHONUNBUFFERED=1

echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
emit "$(python3 - <<'EOF'
import json, os
from jaxdist.distributed.platform import setup_platform
setup_platform(1)  # applies jaxdist's GPU XLA flags (jaxdist/distributed/xla_flags.py) before the backend starts
import jax, flax, optax
d = jax.devices()[0]
stats = d.memory_stats() or {}
print(json.dumps({"check": "device", "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                  "backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()],
                  "device_kind": d.device_kind, "memory_gib": round(stats.get("bytes_limit", 0) / 2**30, 1),
                  "memories": [m.kind for m in d.addressable_memories()], "xla_flags": os.environ.get("XLA_FLAGS", "")}))
EOF
)"

emit "$(python3 - <<'EOF'
import importlib, json, re, tomllib
MODULES = {"orbax-checkpoint": "orbax.checkpoint", "pyyaml": "yaml"}  # import names that differ
deps = [re.split(r"[<>=\[ ;]", d)[0] for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
missing = []
for dep in deps:
    try:
        importlib.import_module(MODULES.get(dep.lower(), dep.replace("-", "_")))
    except Exception as e:
        missing.append(f"{dep}: {type(e).__name__}")
print(json.dumps({"check": "deps", "runtime_dependencies": len(deps), "missing": missing}))
EOF
)"

echo "== tests (GPU-relevant subset, on the GPU) [$(elapsed)s]"
# conftest defaults JAX_PLATFORMS to cpu: name the GPU explicitly. Multi-device tests skip on one GPU.
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_gpu.py tests/test_offload.py tests/test_precision.py 2>&1 | tail -15
emit "{\"check\": \"tests\", \"rc\": ${PIPESTATUS[0]}, \"elapsed_s\": $(elapsed)}"

echo "== offload prefetch: XLA's pipelined host offloading on and off [$(elapsed)s]"
line=$(timeout 120 python3 scripts/memory/offload_prefetch.py 2>/tmp/offload_prefetch.err | tail -1)
if [[ "$line" == \{* ]]; then
  emit "$line"
else
  emit "{\"check\": \"offload_prefetch\", \"error\": $(tail -c 600 /tmp/offload_prefetch.err | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}"
fi

echo "== bench: 1B, bf16, one GPU [$(elapsed)s]"
bench() {  # name, then config overrides; skipped past the 8-minute budget's last safe start
  local name=$1; shift
  local line
  if (( $(elapsed) > 380 )); then
    emit "{\"check\": \"bench\", \"variant\": \"$name\", \"skipped\": \"time budget\"}"
    return
  fi
  line=$(timeout 100 python3 -m jaxdist.bench --config "${BENCH_CONFIG:-configs/1b.yaml}" --mesh fsdp=1 --warmup 2 \
         --steps 5 model.compute_dtype=bfloat16 train.global_batch=2 "$@" 2>"/tmp/bench_$name.err" | tail -1)
  if [[ "$line" == \{* ]]; then
    emit "{\"check\": \"bench\", \"variant\": \"$name\", \"overrides\": \"$*\", \"result\": $line}"
  else
    emit "{\"check\": \"bench\", \"variant\": \"$name\", \"overrides\": \"$*\", \"error\": $(tail -c 600 "/tmp/bench_$name.err" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}"
  fi
}
bench remat_dots model.remat=dots_saveable
bench fp8_tensorwise model.remat=dots_saveable model.fp8=tensorwise  # issue 50: tokens/s against remat_dots
bench fp8_rowwise model.remat=dots_saveable model.fp8=rowwise
# FP8 GEMMs: does XLA:GPU rewrite the FP8 dots into cuBLASLt FP8 custom calls, and gather in 1 byte?
emit "$(timeout 120 python3 - <<'EOF2' 2>/tmp/fp8_hlo.err || echo '{"check": "fp8_hlo", "error": "see /tmp/fp8_hlo.err"}'
import json, re
import jax
from jaxdist import config
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.training import step
out = {"check": "fp8_hlo"}
for name in ("tiny", "tiny-moe"):  # dense layers; + the experts' FP8 SwiGLU (dropless chunk loops)
    cfg = config.load(f"configs/{name}.yaml", ["model.fp8=tensorwise", "model.compute_dtype=bfloat16"])
    prog = step.build_program(cfg, mesh_mod.mesh_from_string("fsdp=1", jax.devices()[:1]))
    tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), "int32", sharding=prog.batch_sharding)
    f = jax.jit(lambda p, t: prog.gradients.apply(p, t, (), 0)[:2], in_shardings=(prog.state_shardings.params, prog.batch_sharding))
    with prog.activate():
        text = f.lower(prog.abstract_state.params, tokens).compile().as_text()
    calls = re.findall(r'custom_call_target="([^"]+)"', text)
    out[name] = {"fp8_gemms": sum("f8" in c for c in calls), "gemm_targets": sorted(set(calls))[:12],
                 "f8_converts": text.count("f8e4m3fn"), "e5m2": text.count("f8e5m2")}
print(json.dumps(out))
EOF2
)"
bench remat_none model.remat=none
bench remat_dots_offload model.remat=dots_saveable offload.optimizer=host
bench remat_full_offload model.remat=full offload.optimizer=host
bench params_offload model.remat=full offload.params=host  # tokens/s against remat_full_offload's line
# the same with XLA's one-iteration-ahead host-to-device copies (the next layer fetched during this one)
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_pipelined_host_offloading=true" \
  bench params_offload_pipelined model.remat=full offload.params=host
bench activations_offload model.remat=none offload.activations=host  # against remat_dots
# issue 50, experts: tiny-moe grown to GPU-sized matmuls (8 layers, d_model 2048, 16 experts of 2048, top-2,
# dropless, no shared expert, seq 4096: chunks of 2·N·K/E = 1024 rows), bf16 vs FP8 tokens/s. Unrun so far.
MOE_BENCH=(model.num_layers=8 model.d_model=2048 model.num_heads=16 model.num_kv_heads=8 model.head_dim=128
           model.moe_experts=16 model.moe_mlp_dim=2048 model.moe_shared_experts=0 model.seq_len=4096
           model.remat=dots_saveable)
BENCH_CONFIG=configs/tiny-moe.yaml bench moe_bf16 "${MOE_BENCH[@]}"
BENCH_CONFIG=configs/tiny-moe.yaml bench moe_fp8_tensorwise "${MOE_BENCH[@]}" model.fp8=tensorwise
BENCH_CONFIG=configs/tiny-moe.yaml bench moe_fp8_rowwise "${MOE_BENCH[@]}" model.fp8=rowwise
# issue 47, pipeline schedules: needs 8 GPUs (pp=4,fsdp=2, scripts/bench/pipeline_bench.py --schedules), so on
# the one-GPU check host it only says so. Unrun so far (no multi-GPU host lent). On 8 GPUs it should show the
# issue's targets on real devices: zb_h1's program-read bubble <= 0.4x 1F1B's at M=8, its temp within 1.2x
# 1F1B's, zb_v's temp below 1F1B's, and each table schedule's tokens/s against GPipe at the same M (on CPU
# zb_h1/zb_v are slower because every device shares the host's cores; a GPU is where the filled bubble pays).
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
if (( NGPU >= 8 )); then
  JAX_PLATFORMS=cuda timeout 300 python3 scripts/bench/pipeline_bench.py --schedules --names 1f1b,zb_h1,zb_v \
    --micro 8 --rounds 2 --json /tmp/pipeline_gpu.jsonl model.d_model=1024 model.num_heads=8 model.num_kv_heads=8 \
    model.head_dim=128 model.mlp_dim=4096 model.seq_len=2048 model.compute_dtype=bfloat16 >/tmp/pipeline_gpu.log 2>&1
  rc=$?
  while read -r rec; do emit "{\"check\": \"pipeline_schedules\", \"record\": $rec}"; done < <(cat /tmp/pipeline_gpu.jsonl 2>/dev/null)
  emit "{\"check\": \"pipeline_schedules\", \"rc\": $rc, \"elapsed_s\": $(elapsed)}"
else
  emit "{\"check\": \"pipeline_schedules\", \"skipped\": \"needs 8 GPUs for pp=4,fsdp=2; this host has $NGPU\"}"
fi
emit "{\"check\": \"done\", \"elapsed_s\": $(elapsed)}"
