"""Builds the native code at install time: the record reader and its request ring (core/io/engine*.c) and the
predictive policy's arithmetic (core/cache/policy.c).

Each is a plain shared library loaded with ctypes (no Python API), built like an extension
so that wheels carry it and the sdist its source. CI adds -Werror through CFLAGS.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mlx_streaming.core.io._engine",
            sources=[
                "mlx_streaming/core/io/engine.c",
                "mlx_streaming/core/io/engine_setup.c",
                "mlx_streaming/core/io/engine_io.c",
                "mlx_streaming/core/io/engine_ring.c",
            ],
            depends=["mlx_streaming/core/io/engine.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-pthread"],
            extra_link_args=["-pthread"],
        ),
        Extension(  # bit-identical to the numpy reference: no fused multiply-adds
            "mlx_streaming.core.cache._policy",
            sources=["mlx_streaming/core/cache/policy.c"],
            depends=["mlx_streaming/core/cache/policy.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-ffp-contract=off"],
        ),
    ]
)
