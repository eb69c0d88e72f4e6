"""Checkout scripts, not installed with the package: ``assets.py`` fetches the offline assets, ``demo.py`` is ``make demo``.

Tests and benchmarks import them as ``scripts.assets`` with the checkout's root on ``sys.path``."""
