"""The one native module (cdcd/lake/landing/_rows.c); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cdcd.lake.landing._rows",
            ["cdcd/lake/landing/_rows.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        )
    ]
)
