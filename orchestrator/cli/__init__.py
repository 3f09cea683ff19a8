"""The ``dtrun`` command line, one module per command noun, each with its own typer app that
``app`` joins (``add_typer`` without a group name, so the commands stay top-level):

``up`` (schema, prices, up and its dry run), ``jobs`` (status, ls, logs, down), ``export``,
``money`` (gc, cost), ``simulate``, ``profile``, ``data`` (the ``data prepare|tokenizer`` group),
``weights``, ``sample``, ``report``; ``live`` is the view while a job runs, ``detached`` the
background controller's process, ``options`` the shared option types. Each module keeps its typer
declarations at the bottom and imports heavy code only when a command runs. Commands parse,
call, print; decisions live in ``plan`` and ``run``. Nothing imports this package.
"""
