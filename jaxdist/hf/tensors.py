"""Hugging Face safetensors <-> sharded jaxdist parameters, one tensor at a time.

Import: every device's shard is read as a slice (`safe_open(...).get_slice`) and put on its device
before the next is read (`make_array_from_callback`, one device at a time), so a process reads only
what its devices hold and host memory stays near one device's slice of one tensor (each file is opened
per read, so its memory map never holds more than that).
Export is `jaxdist.hf.export`.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import SafetensorError, safe_open

from jaxdist.adapters.lora import per_layer_shapes
from jaxdist.checkpoint import Restored
from jaxdist.config import ModelConfig
from jaxdist.distributed import sharding
from jaxdist.errors import JaxdistError
from jaxdist.hf import mapping, mxfp4
from jaxdist.models.resolve import resolve

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
SOURCE = "hf_source"  # run-dir folder keeping the imported model's config, generation config, tokenizer
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",  # transformers 4.43+ keeps the chat template here (generate --chat reads it)
)
TOKENIZER_FILES = SIDE_FILES[2:]


def _inside(name: str) -> bool:
    """`name` names a file inside the folder it is relative to (no absolute path, no `..`). Lexical on
    purpose: a Hub snapshot's files are links into the cache's blobs/, so resolving would leave it."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts and "\\" not in name


class Weights:
    """The safetensors files of a Hugging Face directory: which file holds which tensor."""

    def __init__(self, hf_dir: Path):
        self.dir = Path(hf_dir)
        index, single = self.dir / "model.safetensors.index.json", self.dir / "model.safetensors"
        if index.is_file() and single.is_file():  # transformers would take model.safetensors; no guessing here
            raise JaxdistError(
                f"{self.dir} holds two weight layouts, model.safetensors and model.safetensors.index.json (with its "
                "shards); remove the one that is not the model (a leftover of another download or export)"
            )
        if index.is_file():
            weight_map = mapping.read_json(index, "model.safetensors.index.json").get("weight_map")
            if not isinstance(weight_map, dict):
                raise JaxdistError(f"{index} has no weight_map; re-download the model")
            for key, name in weight_map.items():  # a shard is a file of this folder, never a path out of it
                if not isinstance(name, str) or not _inside(name):
                    raise JaxdistError(
                        f"{index}: weight_map[{str(key)[:80]!r}] = {str(name)[:120]!r} is not a file inside {self.dir}; "
                        "re-download the model (nothing outside the folder is read)"
                    )
            for name in sorted(set(weight_map.values())):
                if not (self.dir / name).is_file():
                    raise JaxdistError(
                        f"shard {self.dir / name} listed in {index.name} is missing; "
                        "download every model-*.safetensors file"
                    )
            self.map = dict(weight_map)
        elif single.is_file():
            with self.open(single.name) as f:
                self.map = dict.fromkeys(f.keys(), single.name)
        else:
            raise JaxdistError(
                f"{self.dir} has no model.safetensors or model.safetensors.index.json; "
                "pass a Hugging Face model directory with safetensors weights"
            )

        # MXFP4 (gpt-oss's published experts): `X_blocks` + `X_scales` stand for `X`, de-quantised on read.
        self.mxfp4: dict[str, tuple[str, str]] = {}
        for key in [k for k in self.map if k.endswith("_blocks")]:
            name = key[: -len("_blocks")]
            if name + "_scales" in self.map and name not in self.map:
                self.mxfp4[name] = (key, name + "_scales")
        for name, (blocks, scales) in self.mxfp4.items():
            self.map[name] = self.map.pop(blocks)
            self.map.pop(scales)

    def _mxfp4_checked(self, name: str, shape: tuple[int, ...]) -> bool:
        """True for an MXFP4 tensor whose de-quantised shape is `shape`; a one-line error for another shape."""
        if name not in self.mxfp4:
            return False
        if self.mxfp4_shape(name) != shape:
            raise JaxdistError(
                f"{name} (MXFP4 blocks) de-quantises to {self.mxfp4_shape(name)} but config.json implies {shape}; "
                "is config.json from the same model?"
            )
        return True

    def mxfp4_shape(self, name: str) -> tuple[int, ...]:
        with self.open(self.map[name]) as f:
            E, R, G, _ = f.get_slice(self.mxfp4[name][0]).get_shape()
        return (E, G * 32, R)

    def mxfp4_read(self, name: str, idx: tuple) -> np.ndarray:
        """Entries `idx` of the de-quantised (E, G*32, R) tensor: the experts idx[0] de-quantised, then sliced."""
        blocks_name, scales_name = self.mxfp4[name]
        with self.open(self.map[name]) as f:
            blocks, scales = f.get_slice(blocks_name)[idx[0]], f.get_slice(scales_name)[idx[0]]
        return mxfp4.dequantize(blocks, scales)[(slice(None), *idx[1:])]

    def open(self, file: str):
        try:
            return safe_open(str(self.dir / file), framework="np")
        except (SafetensorError, OSError) as e:
            raise JaxdistError(
                f"shard {self.dir / file} is unreadable ({str(e).splitlines()[0]}); "
                "it is corrupt or truncated: download it again"
            ) from None

    def check(self, m: ModelConfig) -> None:
        """Every tensor present, with the shape and a dtype we read; nothing unexpected."""
        expected = {}
        for t in mapping.tensors(m):
            shape = mapping.hf_shape(layer_shape(t, m), t.n_in)
            for name in names(t, m):
                expected[name] = shape
        ignored = {"lm_head.weight"} if m.tie_embeddings else set()  # some tied exports keep the copy
        extra = sorted(k for k in set(self.map) - set(expected) - ignored if not k.endswith("rotary_emb.inv_freq"))
        if extra:
            raise JaxdistError(
                f"{self.dir}: unexpected tensor {extra[0]} (not part of a {m.family} model with this "
                "config.json); is config.json from the same model?"
            )
        by_file: dict[str, list[str]] = {}
        for name in expected:
            if name not in self.map:
                raise JaxdistError(
                    f"{self.dir}: tensor {name} is missing from the checkpoint; download "
                    "every shard (or fix config.json)"
                )
            by_file.setdefault(self.map[name], []).append(name)
        for file, wanted in by_file.items():
            with self.open(file) as f:
                present = set(f.keys())
                for name in wanted:
                    if self._mxfp4_checked(name, expected[name]):
                        continue
                    if name not in present:
                        raise JaxdistError(
                            f"shard {self.dir / file} lacks tensor {name} that the index names "
                            "there; download the shard again"
                        )
                    sl = f.get_slice(name)
                    if sl.get_dtype() not in DTYPES:
                        raise JaxdistError(
                            f"{name} is {sl.get_dtype()}; jaxdist imports float32, float16 "
                            "and bfloat16 weights (dequantize first)"
                        )
                    if tuple(sl.get_shape()) != expected[name]:
                        raise JaxdistError(
                            f"{name} has shape {tuple(sl.get_shape())} but config.json implies "
                            f"{expected[name]}; is config.json from the same model?"
                        )


def layer_shape(t: mapping.Tensor, m: ModelConfig) -> tuple[int, ...]:
    """The jaxdist shape of one layer of `t` (no stacking dims; one expert's for per-expert tensors)."""
    if t.shape:
        return tuple(t.shape)
    D, N, K, H, F, V = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
    if t.path[-2:] in (("q_norm", "scale"), ("k_norm", "scale")):
        return (H,)
    Fe = m.moe_mlp_dim or F
    return {
        "bq_NH": (N, H),
        "bk_KH": (K, H),
        "bv_KH": (K, H),
        "router_DE": (D, m.moe_experts),
        "w_gate_EDF": (D, Fe),
        "w_up_EDF": (D, Fe),
        "w_down_EFD": (Fe, D),
        "embed_VD": (V, D),
        "scale": (D,),
        "head_DV": (D, V),
        **per_layer_shapes(m),  # the attention and dense MLP matrices: one table, shared with LoRA
    }[t.path[-1]]


def names(t: mapping.Tensor, m: ModelConfig) -> list[str]:
    """HF names of `t`, stacked entry-major then expert (entry g, expert e at g * E + e)."""
    if not t.stacked:
        return [t.hf]
    experts = range(m.moe_experts) if t.experts else [0]
    return [t.hf.format(i=g * t.every + t.offset, e=e) for g in range(t.depth or m.stack_depth) for e in experts]


def read_block(sl, idx: tuple[slice, ...], shape: tuple[int, ...], n_in: int) -> np.ndarray:
    """Our slice `idx` of one layer of jaxdist shape `shape`, read from HF's (out, in) tensor `sl`.
    A split head dim reads its whole heads' rows, then selects (heads split elsewhere stay exact)."""
    if n_in == 0:
        return sl[idx]
    if n_in == -1:  # flattened in the file: read whole rows of the first dim, then select the rest
        inner = mapping._prod(shape[1:])
        raw = sl[idx[0].start * inner : idx[0].stop * inner].reshape(idx[0].stop - idx[0].start, *shape[1:])
        return raw[(slice(None), *idx[1:])]
    ins, outs = shape[:n_in], shape[n_in:]
    i_idx, o_idx = idx[:n_in], idx[n_in:]
    r_inner, c_inner = mapping._prod(outs[1:]), mapping._prod(ins[1:])
    raw = sl[o_idx[0].start * r_inner : o_idx[0].stop * r_inner, i_idx[0].start * c_inner : i_idx[0].stop * c_inner]
    raw = raw.reshape(o_idx[0].stop - o_idx[0].start, *outs[1:], i_idx[0].stop - i_idx[0].start, *ins[1:])
    raw = raw[(slice(None), *o_idx[1:], slice(None), *i_idx[1:])]
    return raw.transpose(*range(len(outs), len(outs) + len(ins)), *range(len(outs)))


def load(hf_dir: Path, m: ModelConfig, abstract: dict, shardings: dict, stages: int = 1, repeats: int = 1) -> dict:
    """The HF weights as jaxdist parameters (float32) laid out as `abstract` with `shardings`: global
    arrays built from per-device slices. `stages`/`repeats`: the pipeline's (stage, layers) stacking."""
    weights = Weights(hf_dir)
    weights.check(m)
    params: dict = {}
    for t in mapping.tensors(m):
        target = mapping.get_path(abstract, t.path)
        shape, lead = layer_shape(t, m), len(target.shape) - len(layer_shape(t, m))
        file_names = names(t, m)

        def callback(index, t=t, shape=shape, lead=lead, file_names=file_names, target=target):
            idx = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, target.shape))
            per_layer, stack = idx[lead:], [range(s.start, s.stop) for s in idx[:lead]]
            # Per-expert tensors: the last stacking dim is the expert; a device reads only its experts.
            experts = stack.pop() if t.experts else range(1)
            layers = [[0]] if not stack else _layer_ids(stack, m.pipeline_depth, stages, repeats)
            per, out = (m.moe_experts if t.experts else 1), []
            for group in layers:
                for i in group:
                    for e in experts:
                        name = file_names[i * per + e]
                        if name in weights.mxfp4 and t.n_in == 0:
                            out.append(weights.mxfp4_read(name, per_layer))
                            continue
                        with weights.open(weights.map[name]) as f:
                            sl = f.get_slice(name)
                            out.append(np.asarray(read_block(sl, per_layer, shape, t.n_in), np.float32))
            block = np.stack(out) if lead else out[0]
            return block.reshape(tuple(s.stop - s.start for s in idx[:lead]) + block.shape[1 if lead else 0 :])

        node = params
        for k in t.path[:-1]:
            node = node.setdefault(k, {})
        node[t.path[-1]] = _from_slices(target.shape, mapping.get_path(shardings, t.path), callback)
    return params


def _from_slices(shape, sharding, callback):
    """`jax.make_array_from_callback`, but each device's slice is transferred (and its host copy freed)
    before the next is read: host memory holds one device's slice, not all of this process's at once."""
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        arrays.append(jax.device_put(callback(index), device))
        arrays[-1].block_until_ready()
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _layer_ids(stack: list[range], num_layers: int, stages: int, repeats: int) -> list[list[int]]:
    """Layer indices for the stacked dims' ranges: (layers,) or, pipelined, (stage, position) where
    position v G + j of stage s holds layer (v P + s) G + j (see parallel/pipeline.py)."""
    if len(stack) == 1:
        return [list(stack[0])]
    group = num_layers // (stages * repeats)
    return [[((p // group) * stages + s) * group + p % group for p in stack[1]] for s in stack[0]]


def import_params(hf_dir: Path, cfg, mesh, rules=None):
    """HF weights onto `mesh` laid out as `cfg`'s model (pipeline stages included) -> (params, resolved)."""

    rules = rules or sharding.make_rules(cfg.mesh.rules)
    model = resolve(cfg, mesh, rules)
    plan = model.pipeline
    params = load(
        hf_dir,
        cfg.model,
        model.abstract,
        sharding.named(mesh, model.specs),
        stages=plan.stages if plan else 1,
        repeats=plan.repeats if plan else 1,
    )
    check_finite(params, mesh, hf_dir)
    return params, model


def check_finite(params, mesh, where: Path) -> None:
    """NaN or Inf in imported weights (a damaged download) is refused here, not found as a NaN loss later."""
    replicated = NamedSharding(mesh, P())
    with jax.set_mesh(mesh):
        finite = jax.jit(lambda p: jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), p), out_shardings=replicated)(
            params
        )
    for path, ok in jax.tree_util.tree_leaves_with_path(jax.device_get(finite)):
        if not bool(ok):
            raise JaxdistError(
                f"{where}: tensor {jax.tree_util.keystr(path)} holds NaN or Inf values; the checkpoint is "
                "damaged (download or export it again)"
            )


def restore_for_training(hf_dir: str, prog, cfg):
    """`--restore hf:HF_DIR`: a fresh train state (step 0, new optimizer) holding the HF weights. With
    lora.rank > 0 they are the frozen base: adapters are initialised and the base stored in its dtype."""
    start = time.perf_counter()
    plain = cfg.replace(lora=dict(rank=0, base_dtype="float32")) if cfg.lora.rank else cfg
    params, _ = import_params(Path(hf_dir), plain, prog.mesh, prog.rules)
    st = prog.state_from_params(params)
    return Restored(st, 0, Path(hf_dir), time.perf_counter() - start)
