"""Benchmarks (run as scripts: ``python bench/NAME.py``); the tests import launch.py from here."""
