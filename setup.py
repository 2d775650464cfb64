"""The native modules (cdcd/lake/landing/_rows.c, cdcd/wal/_entries.c); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cdcd.wal._entries",
            ["cdcd/wal/_entries.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "cdcd.lake.landing._rows",
            ["cdcd/lake/landing/_rows.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        )
    ]
)
