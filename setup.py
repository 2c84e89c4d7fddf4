"""Build hook for the optional C chain loop; everything else is in pyproject.toml.

The extension is optional: without a compiler or Debian's libxxhash-dev the
install still succeeds and store/keys.py uses its pure-Python loop.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("store._chain", ["store/_chain.c"], optional=True, extra_compile_args=["-O3"])])
