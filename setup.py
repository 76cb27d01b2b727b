# The metadata lives in pyproject.toml; this stub lets tools that still call setup.py (`python setup.py
# --version`, older editable installs) read it from there.
from setuptools import setup

setup()
