"""The Modal lab: a local Modal control plane the real ``modal`` client talks to, whose sandboxes
execute (``control.py`` says what it emulates and what not), with a CLI beside it
(``python -m tests.e2e.clouds.modal_lab serve --execute``; ``__main__.py``)."""

from tests.e2e.clouds.modal_lab.control import ExecutingModal, catalog_price

__all__ = ["ExecutingModal", "catalog_price"]
