"""A job while it runs: the controller and what it leans on.

The controller in parts, ``controller.Controller`` the front door:
``prepare`` (the one plan per ``up``: resolved spec, estimate, chosen offer, checkpoint interval,
saved for a detached controller), ``startup`` (the checks before anything is written or rented),
``context`` (the job's spec, store, clock, providers and events), ``launching`` and
``launchthread`` (a launch on its own thread, errors mapped to what happens next), ``ledger``
(spend booked per attempt, burn rate, abandoned launches), ``observe`` (polls and run-URI reads →
one typed view of an attempt), ``outcome`` (``Outcome`` and the pure ``decide`` over that view),
``watching`` (a live attempt each tick), ``teardown`` (terminate, cancel, adopt, graceful stop,
finish: what ``dtrun down`` uses), ``recovery`` (which offer next, attempt and restart limits,
backoff), ``loop`` (ticking, with backoff on a failing tick).

Beside it: ``guard`` (budget and deadline), ``state`` and ``statedb`` (the SQLite store under
``$DTRUN_HOME``), ``clock``, ``sweep`` (orphans), ``nodecreds`` (storage credentials for nodes),
``preflight`` and ``uricheck`` and ``readiness`` (checks before renting), ``datacheck`` (the data
manifest's vocabulary against the model), ``codeship`` (the user's code to the node),
``simulate`` and ``simnode`` (the real controller against the fake cloud), ``report`` (``dtrun
report``: HTML + PNG plots; matplotlib imported only there).

May import ``plan``, ``contract`` and ``providers``; never ``cli``, never ``trainer``.
"""
