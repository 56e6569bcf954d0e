"""Builds the C extensions (the server's int64 key index and its row loops); the rest is in
pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ps._index",
            sources=["ps/_index.c"],
            extra_compile_args=["-O3", "-std=c11"],
        ),
        Extension(
            "ps._rows",
            sources=["ps/_rows.c"],
            # No FMA contraction: row updates must round as torch's separate ops do; no errno
            # from sqrt, so that the Adagrad loop vectorises.
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno"],
        ),
    ]
)
