"""Benchmarks, run as scripts (``python bench/NAME.py``). A package too, so that the tests
can import launch.py and fake_pynvml.py from here; nothing in bench imports the tests."""
