"""Build hook: the cffi extension kvdepot._native (compiled against kvdepot.h)."""
from setuptools import setup

setup(cffi_modules=["kvdepot/_build.py:ffi"])
