"""The ``dtrun`` command line: ``app`` holds the typer app; one module per command noun
(``up``: dry run and prices, ``jobs``: up/status/ls/logs/down, ``live``: the view while a job
runs, ``money``: gc and cost, ``simulate``, ``profile``, ``export``, ``detached``: the
background controller's process). Commands parse, call, print; decisions live in ``plan`` and
``run``. Nothing imports this package.
"""
