"""The emulated clouds dtrun's end-to-end suites run against: test infrastructure, not product.

One package per cloud, each with a ``__main__`` CLI (``python -m tests.e2e.clouds.<cloud> …``):
``lambdalab`` (Lambda Cloud's REST API over namespaced sshd machines that the real SkyPilot
provisions), ``modal_lab`` (an executing Modal control plane the real ``modal`` client drives),
``pricelab`` (the three price APIs SkyPilot's catalog fetchers read). Each says at its top what it
does not emulate. The product never imports these (``providers/`` has no test-only branches).
"""
