"""Every CUDA kernel the package builds, compiled on the CPU machine with ``nvcc``.

MLX compiles a ``mx.fast.cuda_kernel`` only when it first runs, on a CUDA machine; an
error in a kernel's text would otherwise first show there, in device time. Here each
kernel's full text is built the way MLX 0.32's ``build_kernel`` builds it (its header,
then a ``__global__`` function whose parameters are the named inputs and outputs, then
the source, its constants written into it as ``constexpr int`` lines by
``kernels.with_consts`` as the package does) and compiled for the H200 (sm_90) with
every warning an error. MLX's default header (``device/utils.cuh``, not in
the CPU wheel) is stood in for by the fixed-width integer types, the only part of it
these kernels use. The semantics are checked on the device, by ``tests/test_cuda.py``.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from mlx_streaming.core.cache import plan_kernel
from mlx_streaming.core.cache.pool import ADDRESS_SOURCE
from mlx_streaming.core.cache.scored import WINDOWS
from mlx_streaming.core.io import device_reader, transfers
from mlx_streaming.core.io.kernels import with_consts

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")

_STAND_IN = "#include <cstdint>\n#include <cooperative_groups.h>\n"


def build(name, source, inputs, outputs, consts=(), header="") -> tuple[str, str]:
    """``source`` as the package makes it for ``consts`` (``kernels.with_consts``), wrapped
    as MLX wraps it: ``inputs`` and ``outputs`` are ``(name, C type)``. Returns the
    variant's name and text."""
    name, source = with_consts(name, source, tuple(consts))
    params = [f"    const {t}* {n}" for n, t in inputs] + [f"    {t}* {n}" for n, t in outputs]
    return name, (
        f"{header}namespace mlx::core::cu {{\n\nnamespace cg = cooperative_groups;\n\n"
        f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n"
        f"{source}\n}}\n\n}} // namespace mlx::core::cu\n"
    )


def compile_ok(tmp_path, name: str, text: str) -> None:
    src = tmp_path / f"{name}.cu"
    src.write_text(_STAND_IN + text)
    cmd = [NVCC, "-arch=sm_90", "-std=c++17", "-c", "-o", str(tmp_path / f"{name}.o")]
    cmd += ["-Werror", "all-warnings", "-Xcompiler", "-Wall", str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    numbered = "\n".join(f"{i + 1:4d} {x}" for i, x in enumerate(text.splitlines()))
    assert r.returncode == 0, f"nvcc refused {name}:\n{r.stderr}\n{numbered}"


def kernels() -> dict[str, str]:
    """Each kernel the package builds, in each variant its Python side can ask for: its
    name and full text (as MLX builds it, header included)."""
    words, out = device_reader._WORDS, {}
    plan_in, plan_out = plan_kernel.PLAN_NAMES
    plan_types = dict(zip(plan_in, ["uint32_t", "uint64_t", "int64_t", "uint32_t"]))
    fill_in, fill_out = device_reader.FILL_NAMES
    fill_types = dict(zip(fill_in, ["int32_t", "uint32_t", "int64_t"]))

    def add(*args, **kw):
        name, text = build(*args, **kw)
        out[name] = text

    for word, c_word in words.items():
        # records copied in, traded with a whole swap tier, or a bounded one (of R rows)
        for swap, rows in ((False, None), (True, None), (True, 20), (True, 0)):
            for score in (0.0, 1.0):  # the LRU ranking (no score) and the scored one
                weights = [score] * (3 + len(WINDOWS))
                add(
                    f"mlxs_plan_{word}",  # as plan_kernel names it
                    plan_kernel.PLAN.replace("WORD", c_word),
                    [(n, plan_types[n]) for n in plan_in],
                    [(plan_out[0], "uint32_t")],
                    plan_kernel.plan_constants(64, 32, 6, weights, swap, rows),
                    device_reader.COPY_HEADER + plan_kernel.TIER_COPY,
                )
        for mode in (0, 1, 3):  # the fill kernel: in, trading, from the ring's staging
            add(
                f"mlxs_fill_{word}",
                device_reader._FILL.replace("WORD", c_word),
                [(n, fill_types[n]) for n in fill_in],
                [(fill_out[0], "uint32_t")],
                [("N", 6), ("MODE", mode)],
                device_reader.COPY_HEADER,
            )
    for ids in ("int32_t", "uint32_t"):
        add(f"mlxs_routing_to_host_{ids}", transfers._SOURCE, [("ids", ids), ("dst", "uint64_t")],
            [("done", "int32_t")], [("N", 6)])  # fmt: skip
    add("mlxs_ids_to_device", transfers._TO_DEVICE, [("addr", "uint64_t")], [("out", "uint32_t")],
        [("N", 6)])  # fmt: skip
    add("mlxs_address", ADDRESS_SOURCE, [("a", "uint8_t")], [("p", "uint64_t")])
    return out


def test_every_kernel_compiles(tmp_path):
    """All kernels in one compilation (each in a namespace of its own, since each carries
    its header, as MLX compiles them one by one); on a failure, each alone, to name it."""
    every = kernels()
    try:
        compile_ok(tmp_path, "all", "".join(f"namespace {n} {{\n{t}}}\n" for n, t in every.items()))
    except AssertionError:
        failures = []
        for name, text in every.items():
            try:
                compile_ok(tmp_path, name, text)
            except AssertionError as e:
                failures.append(str(e))
        assert failures, "nvcc refused the kernels together and accepted each alone"
        raise AssertionError("\n\n".join(failures)) from None


def test_a_broken_kernel_is_refused(tmp_path):
    """The check can fail: an undeclared name, and a warning (an unused variable)."""
    with pytest.raises(AssertionError, match="nvcc refused"):
        compile_ok(tmp_path, "bad", build("bad", "out[0] = nothing;", [], [("out", "int")])[1])
    with pytest.raises(AssertionError, match="nvcc refused"):
        text = build("warn", "int unused = 1;\nout[0] = 0;", [], [("out", "int")])[1]
        compile_ok(tmp_path, "warn", text)
