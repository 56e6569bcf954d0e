"""Builds the one C extension (the server's int64 key index); the rest is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ps._index",
            sources=["ps/_index.c"],
            extra_compile_args=["-O3", "-std=c11"],
        )
    ]
)
