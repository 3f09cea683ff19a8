"""A job while it runs: the controller and what it leans on.

``controller`` (the state machine over a clock), ``recovery`` (which offer next), ``guard``
(budget and deadline), ``state`` (SQLite store under ``$DTRUN_HOME``), ``clock``, ``sweep``
(orphans), ``nodecreds`` (storage credentials for nodes), ``preflight``, ``simulate`` (the real
controller against the fake cloud), ``report`` (``dtrun report``: HTML + PNG plots from the state
store and the run URI; matplotlib imported only there), ``datacheck`` (the data manifest's
tokenizer vocabulary against the model, before renting). May import ``plan``, ``contract`` and ``providers``; never ``cli``.
"""
