"""Builds the native record reader (mlx_streaming/core/io/engine*.c) at install time.

It is a plain shared library loaded with ctypes (no Python API), built like an extension
so that wheels carry it and the sdist its source. CI adds -Werror through CFLAGS.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mlx_streaming.core.io._engine",
            sources=["mlx_streaming/core/io/engine.c", "mlx_streaming/core/io/engine_io.c"],
            depends=["mlx_streaming/core/io/engine.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ]
)
