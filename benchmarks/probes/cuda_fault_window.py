"""Replay test_cuda's device-* cases, then
stock host-tiny-mixtral, with a CUDA health check after every stage, to find the first
stage after which the context holds the sticky illegal-address error.

On the device (written by a reviewing helper, 2026-12-03; not yet run):
  CUDA_LAUNCH_BLOCKING=1 MLX_PTX_CACHE_DIR=/tmp/mlxs-ptx timeout 170 \
    python3 benchmarks/probes/cuda_fault_window.py tiny-qwen3_next          # or: tiny-mixtral thresholds-qwen3_moe tiny-qwen3_next
"""

import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import mlx.core as mx

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # its docstring is its help
    print(__doc__)
    sys.exit(0)
if __name__ == "__main__" and not mx.cuda.is_available():
    sys.exit(f"{__file__}: a probe of MLX's CUDA backend, which this machine lacks")
from conftest import Models
from mlx_lm import load

import mlx_streaming
from mlx_streaming.analysis.verify import compare_traces, greedy_trace
from mlx_streaming.core.cache import pool as poolmod
from mlx_streaming.core.io import cuda
from mlx_streaming.core.io import device_reader as drmod
from mlx_streaming.core.meta import load_meta

TEXT = "A mixture of experts routes each token to a few experts out of many. " * 3
T0 = time.time()


def ok(tag):
    try:
        mx.eval(mx.arange(4096) * 2 + 1)
        mx.synchronize()
    except Exception as e:
        print(f"[{time.time() - T0:6.1f}s] FAULT (MLX) at {tag}: {e!r}", flush=True)
        sys.exit(3)
    err = cuda.lib().cudaDeviceSynchronize()  # every stream, MLX's and ours
    if err:
        print(f"[{time.time() - T0:6.1f}s] FAULT (cudart {err}) at {tag}", flush=True)
        sys.exit(3)
    print(f"[{time.time() - T0:6.1f}s] ok {tag}", flush=True)


# host-side range checks on every slot id the host path hands the GPU
_slots_of = poolmod.LayerPool.slots_of


def slots_of(self, experts, reserved=None):
    out = _slots_of(self, experts, reserved)
    hi = self.slots if self.dummy is None else self.dummy + 1
    if out.size and (out.min() < 0 or out.max() >= hi):
        raise AssertionError(f"slots_of out of range: {out.tolist()} (rows {hi})")
    return out


poolmod.LayerPool.slots_of = slots_of
_start = drmod.DeviceReader.start


def start(self, layer, experts, slots):
    p = self.pools[layer]
    if len(slots) and (
        min(slots) < 0 or max(slots) >= p.slots or max(experts) >= p.layout.num_experts
    ):
        raise AssertionError(f"fill out of range: layer {layer} {list(experts)} -> {list(slots)}")
    return _start(self, layer, experts, slots)


drmod.DeviceReader.start = start

models = Models(Path(tempfile.mkdtemp()))
presets = sys.argv[1:] or ["tiny-qwen3_next"]
ok("start")
for preset in presets:
    ck, ed = models.experts(preset, dtype="bfloat16")
    ref, tok = load(str(ck))
    ids = tok.encode(TEXT)
    want = {c: greedy_trace(ref, ids, 12, c) for c in (8, 64)}
    ok(f"{preset} stock")
    del ref
    gc.collect()
    meta = load_meta(ed)
    kf = Path(tempfile.mkdtemp()) / "k.json"
    for slots in (meta.top_k, meta.num_experts // 2, meta.num_experts):
        model, _, store = mlx_streaming.load(
            ck,
            ed,
            slots=slots,
            config=mlx_streaming.StreamConfig(kernel_check=True, kernel_check_file=kf),
        )
        ok(f"{preset} slots={slots} loaded")
        for chunk, rt in want.items():
            cmp = compare_traces(rt, greedy_trace(model, ids, 12, chunk))
            ok(f"{preset} slots={slots} chunk={chunk} exact={cmp.exact}")
        store.totals()
        ok(f"{preset} slots={slots} totals")
        store.close()
        ok(f"{preset} slots={slots} close")
        del model, store
        gc.collect()
        ok(f"{preset} slots={slots} gc")
    mx.clear_cache()
    ok(f"{preset} clear_cache")
ck, ed = models.experts("tiny-mixtral", dtype="bfloat16")
ref, tok = load(str(ck))
ok("host-tiny-mixtral stock load")
greedy_trace(ref, tok.encode(TEXT), 12, 8)
ok("host-tiny-mixtral stock greedy (where the suite failed)")
print("no fault", flush=True)
