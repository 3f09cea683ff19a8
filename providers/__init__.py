"""Where nodes come from: one small interface (``base``), one module or folder per provider.

``base`` (Offer, Requirements, LaunchRequest, Handle, NodeState, the Provider protocol),
``errors`` (NoCapacity, QuotaExceeded, AuthError, Transient, NotSupported), ``pricing`` (the
dated price snapshot, region and offer rules: each provider yields its own offers from it, with
its own catalog where it has one), ``catalog`` (every provider's prices and start-up figures, for
the orchestrator; no provider imports it), ``registry`` (name → provider), then ``skypilot/``,
``modal/``, ``local/`` and ``fake/``.

May import ``orchestrator.contract`` (run-URI exit codes, GPU names) and nothing else of the
orchestrator: the orchestrator calls providers, never the other way round.
"""
