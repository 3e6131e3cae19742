"""The package's MLX CUDA kernels: one kernel per value of its constants.

A kernel's constants (an id count, an expert count...) are written into its source as
``constexpr int`` lines, where MLX would put template arguments, and each set of values
is a kernel of its own: MLX 0.32 formats template arguments anew at every call, 2-6 µs
of the host's time per call on the H200 (``benchmarks/probes/kernel_call_cost.py``),
where a kernel per variant costs nothing per call.
"""

from __future__ import annotations

import re

import mlx.core as mx

Consts = tuple[tuple[str, int], ...]  # (name, value) of each constant

# A declaration in a kernel's body: a C type, an optional pointer star, the name.
_DECLARED = re.compile(
    r"\b(?:int|long long|float|double|char|bool|auto|\w+_t)\s*\*?\s+(\w+)\s*[=;\[]"
)


def check_names(name: str, source: str, names: list[str]) -> None:
    """MLX declares a kernel's inputs and outputs by name in the body it wraps around
    ``source``, so the source may not declare them again (nvcc would refuse it, and only
    on a CUDA machine).

    Raises:
        ValueError: naming the kernel and the clashing names.
    """
    clash = sorted(set(names) & set(_DECLARED.findall(source)))
    if clash:
        raise ValueError(
            f"kernel {name}: {clash} are its inputs or outputs and declared in its source; "
            "rename one"
        )


def with_consts(name: str, source: str, consts: Consts) -> tuple[str, str]:
    """The name and source of ``name``'s variant for ``consts``."""
    suffix = "".join(f"_{v}" for _, v in consts)
    decl = "".join(f"    constexpr int {k} = {v};\n" for k, v in consts)
    return name + suffix, decl + source


class Kernels:
    """A CUDA kernel's variants, made on first use: ``kernels(consts)`` is the MLX kernel
    for those constants (call it as MLX's, without ``template``)."""

    def __init__(self, name, source, input_names, output_names, header=""):
        check_names(name, source, [*input_names, *output_names])
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self._made: dict[Consts, object] = {}

    def __call__(self, consts: Consts):
        kernel = self._made.get(consts)
        if kernel is None:
            name, source = with_consts(self.name, self.source, consts)
            kernel = self._made[consts] = mx.fast.cuda_kernel(
                name=name,
                input_names=self.input_names,
                output_names=self.output_names,
                source=source,
                header=self.header,
            )
        return kernel
