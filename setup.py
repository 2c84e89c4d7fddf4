"""Build hook for the optional C chain loop; everything else is in pyproject.toml.

The extension is optional: without a compiler or Debian's libxxhash-dev the
install still succeeds and prefixpool/store/keys.py uses its pure-Python loop.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("prefixpool.store._chain", ["prefixpool/store/_chain.c"], optional=True,
                             extra_compile_args=["-O3"])])
