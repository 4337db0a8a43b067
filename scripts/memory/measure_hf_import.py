"""Peak host memory of importing a Hugging Face Llama (jaxdist.hf.tensors), on the largest model we can make here.

    python scripts/memory/measure_hf_import.py [--dir /tmp/jaxdist-hf-1b] [--mesh fsdp=8] [--cli]

Writes (once) a random Llama-3.2-1B-shaped checkpoint in bf16 — numpy + safetensors, sharded at 1 GB with
an index, as `save_pretrained` lays it out — then imports it in a fresh process and reports, from
/proc/self/status: the baseline RSS (jax up, mesh built), the peak RSS (VmHWM), the bytes of the imported
float32 parameters (on CPU the 'devices' are host memory, so they are part of RSS; on a GPU they are not),
and the loader's own overhead = peak - baseline - parameters, against the largest single tensor.
--cli measures `python -m jaxdist.convert from-hf` end to end instead (orbax's save included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parents[2]
SHAPE = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def hf_tensors(c: dict):
    D, F, N, K, H, V = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        c["vocab_size"],
    )
    yield "model.embed_tokens.weight", (V, D)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (D,)
        yield p + "self_attn.q_proj.weight", (N * H, D)
        yield p + "self_attn.k_proj.weight", (K * H, D)
        yield p + "self_attn.v_proj.weight", (K * H, D)
        yield p + "self_attn.o_proj.weight", (D, N * H)
        yield p + "post_attention_layernorm.weight", (D,)
        yield p + "mlp.gate_proj.weight", (F, D)
        yield p + "mlp.up_proj.weight", (F, D)
        yield p + "mlp.down_proj.weight", (D, F)
    yield "model.norm.weight", (D,)


def write_model(out: Path, shard_bytes: int = 10**9) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shards, current, size = [], {}, 0
    for name, shape in hf_tensors(SHAPE):
        a = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if current and size + a.nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = a, size + a.nbytes
        if len(current) == 1 and a.nbytes > shard_bytes:  # a tensor larger than a shard gets its own
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(int(np.prod(s)) * 2 for _, s in hf_tensors(SHAPE))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (out / "config.json").write_text(json.dumps(SHAPE, indent=2))


CHILD = r"""
import json, sys, time
from pathlib import Path
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from jaxdist.distributed.platform import setup_platform
setup_platform(8)
import jax
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.hf import mapping, tensors
hf_dir, mesh_text = Path(sys.argv[1]), sys.argv[2]
cfg = mapping.hf_config(None, [], hf_dir, mesh_text)
mesh = mesh_mod.mesh_from_string(mesh_text)
jax.block_until_ready(jax.device_put(jax.numpy.zeros(8), jax.devices()[0]))
baseline = status('VmRSS')
t = time.perf_counter()
params, _ = tensors.import_params(hf_dir, cfg, mesh)
jax.block_until_ready(params)
seconds = time.perf_counter() - t
param_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
print(json.dumps({"baseline": baseline, "peak": status('VmHWM'), "params": param_bytes, "seconds": seconds}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/jaxdist-hf-1b")
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--cli", action="store_true", help="measure `jaxdist.convert from-hf` end to end")
    args = p.parse_args()
    hf_dir = Path(args.dir)
    if not (hf_dir / "model.safetensors.index.json").is_file():
        print(f"writing a random 1B-shaped model to {hf_dir} ...", flush=True)
        write_model(hf_dir)
    largest = max(int(np.prod(s)) for _, s in hf_tensors(SHAPE))
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    gib = 2**30
    print(
        f"largest tensor: {largest / 1e6:.0f}M entries = {largest * 2 / gib:.2f} GiB bf16 on disk, "
        f"{largest * 4 / gib:.2f} GiB as float32"
    )
    if args.cli:
        out = hf_dir.parent / (hf_dir.name + "-run")
        subprocess.run(["rm", "-rf", str(out)], check=True)
        subprocess.run(
            [sys.executable, "-m", "jaxdist.convert", "from-hf", str(hf_dir), str(out), "--mesh", args.mesh],
            cwd=REPO,
            env=env,
            check=True,
        )
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print(f"from-hf end to end (orbax save included): peak RSS {peak / gib:.2f} GiB")
        return
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(hf_dir), args.mesh],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    m = json.loads(r.stdout.strip().splitlines()[-1])
    overhead = m["peak"] - m["baseline"] - m["params"]
    print(
        f"import onto {args.mesh} in {m['seconds']:.0f}s: baseline RSS {m['baseline'] / gib:.2f} GiB, peak "
        f"{m['peak'] / gib:.2f} GiB, imported float32 parameters {m['params'] / gib:.2f} GiB (CPU devices = host "
        f"memory); loader overhead {overhead / gib:.3f} GiB = {overhead / (largest * 4):.2f} x the largest "
        "tensor in float32"
    )


if __name__ == "__main__":
    main()
