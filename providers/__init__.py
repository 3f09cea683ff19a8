"""Where nodes come from: one small interface (``base``), one module or folder per provider.

``base`` (Offer, Requirements, LaunchRequest, Handle, NodeState, the Provider protocol),
``errors`` (NoCapacity, QuotaExceeded, AuthError, Transient, NotSupported), ``catalog`` (the
dated price snapshot and SkyPilot's catalogs: each provider yields its own offers from it),
``registry`` (name → provider), then ``skypilot/``, ``modal/``, ``local/`` and ``fake``.

May import ``orchestrator.contract`` (run-URI exit codes, GPU names) and nothing else of the
orchestrator: the orchestrator calls providers, never the other way round.
"""
