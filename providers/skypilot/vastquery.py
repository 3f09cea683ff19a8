"""SkyPilot's Vast offer search, made to carry its filters: a SkyPilot API-server plugin.

SkyPilot 0.14.1 searches Vast's offers with a query string whose values it quotes
(``geolocation="NA" disk_space>=256 num_gpus=1 gpu_name="H100 SXM" cpu_ram>="64.0"`` after
``chunked=true georegion=true``, ``sky/provision/vast/utils.py``). The vastai 1.9.1 SDK's
pre-parser (``vastai.utils.preprocess_search_query``) reads values as ``Word(alphanums + "_")``,
so pyparsing stops at the first quoted value and the SDK keeps only what came before it: the two
directives, which it strips. The query that reaches ``POST /api/v0/bundles/`` is empty, and
SkyPilot rents ``offers[0]`` of the whole market — an RTX 4090 for an H100 job on the Vast lab.
The SDK's own query parser (``vastai.api.query.parse_query``) reads quoted values correctly; only
the pre-parser drops them.

:func:`preprocess_search_query` is the pre-parser with the same contract and the same two
directives (``georegion=true`` expands a region code such as ``NA`` into ``geolocation in
[<countries>]`` with the SDK's own table; ``chunked=true`` is the SDK's post-processing), but it
keeps every other clause as SkyPilot wrote it, quoted or not. :class:`VastQueryFix` installs it
into the vastai SDK in each request executor of SkyPilot's API server, through SkyPilot's own
plugin mechanism (``SKYPILOT_SERVER_PLUGINS_CONFIG``, ``sky.server.plugins``): :func:`plugins_config`
writes the config (the user's own plugins kept) and :meth:`providers.skypilot.api.SkyAPI.ensure_server`
starts the API server with it. An API server dtrun did not start (the user's, or a remote one)
runs without it: there the search still rents the market's top offer, and dtrun's check of the
rented instance (:mod:`providers.skypilot.vastcheck`) destroys a wrong GPU and refuses the offer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

PLUGIN_CLASS = "providers.skypilot.vastquery.VastQueryFix"
PLUGINS_ENV = "SKYPILOT_SERVER_PLUGINS_CONFIG"
"""SkyPilot's variable for the API server's plugins file (``sky/server/plugins.py``); its default
is ``~/.sky/plugins.yaml``."""
USER_PLUGINS = "~/.sky/plugins.yaml"

_CLAUSE = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|!=|=|>|<|\bnotin\b|\bin\b)\s*'
                     r'("[^"]*"|\[[^\]]*\]|[^\s"\[\]]+)')
_DIRECTIVES = ("georegion", "chunked")


def clauses(query: str) -> list[tuple[str, str, str]] | None:
    """``(key, operator, value)`` for every clause of ``query`` (a value keeps its quotes or
    brackets); None when some of it is not a clause (then nothing is rewritten)."""
    out, pos = [], 0
    while pos < len(query):
        if not query[pos:].strip():
            break
        m = _CLAUSE.match(query, pos)
        if not m:
            return None
        out.append((m.group(1), m.group(2), m.group(3)))
        pos = m.end()
    return out


def preprocess_search_query(query_str: str | None) -> tuple[bool, bool, str | None]:
    """``(georegion, chunked, query)`` as ``vastai.utils.preprocess_search_query`` returns them,
    with every clause but the two directives kept (quoted values included)."""
    if query_str is None:
        return False, False, query_str
    parsed = clauses(query_str)
    if parsed is None:
        import vastai.utils as vutils  # something the SDK's own pre-parser may read: leave it to it

        return (_SDK_PREPROCESS or vutils.preprocess_search_query)(query_str)
    state = {d: any(k == d and op == "=" and v.strip('"') == "true" for k, op, v in parsed) for d in _DIRECTIVES}
    if not any(state.values()):
        return False, False, query_str
    from vastai.utils import _regions

    parts = []
    for k, op, v in parsed:
        if k in _DIRECTIVES:
            continue
        code = v.strip('"')
        if k == "geolocation" and op == "=" and state["georegion"] and code in _regions:
            parts.append(f"geolocation in [{_regions[code]}]")
        else:
            parts.append(f"{k}{op}{v}" if op not in ("in", "notin") else f"{k} {op} {v}")
    return state["georegion"], state["chunked"], " ".join(parts)


_SDK_PREPROCESS: Any = None
"""The SDK's pre-parser as it was before :func:`install` replaced it (the fallback)."""


def install() -> bool:
    """Put :func:`preprocess_search_query` into the vastai SDK of this process (``search_offers``
    looks it up in ``vastai.utils`` at each call). False when vastai is not installed."""
    global _SDK_PREPROCESS
    try:
        import vastai.utils as vutils
    except ImportError:
        return False
    if vutils.preprocess_search_query is not preprocess_search_query:
        _SDK_PREPROCESS = vutils.preprocess_search_query
        vutils.preprocess_search_query = preprocess_search_query
    return True


def plugins_config(dest: Path, user_config: str | None = None) -> Path | None:
    """Write SkyPilot's plugins file for an API server dtrun starts: the user's plugins (from
    ``user_config``, else ``$SKYPILOT_SERVER_PLUGINS_CONFIG``, else ``~/.sky/plugins.yaml``) with
    :class:`VastQueryFix` added once. None (write nothing) when the user's file cannot be read as
    a plugins file: their server config stays as it is, and dtrun's check of the rented
    instance is what guards Vast launches."""
    import yaml

    src = Path(os.path.expanduser(user_config or os.environ.get(PLUGINS_ENV) or USER_PLUGINS))
    cfg: dict[str, Any] = {}
    if src.exists() and src.resolve() != dest.resolve():
        try:
            cfg = yaml.safe_load(src.read_text()) or {}
        except (OSError, yaml.YAMLError):
            return None
        if not isinstance(cfg, dict) or not isinstance(cfg.get("plugins", []), list):
            return None
    plugins = list(cfg.get("plugins") or [])
    if not any(isinstance(p, dict) and p.get("class") == PLUGIN_CLASS for p in plugins):
        plugins.append({"class": PLUGIN_CLASS})
    cfg["plugins"] = plugins
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    os.replace(tmp, dest)
    return dest


def _plugin_base() -> Any:
    try:
        from sky.server import plugins
    except ImportError:  # no SkyPilot here: the class is only ever loaded by its API server
        return object, frozenset()
    return plugins.BasePlugin, frozenset({plugins.PluginContext.EXECUTOR})


_Base, _CONTEXTS = _plugin_base()


class VastQueryFix(_Base):  # type: ignore[misc,valid-type]
    """SkyPilot API-server plugin: the request executors (where ``sky.launch`` provisions) search
    Vast with every filter SkyPilot wrote (:func:`install`)."""

    load_contexts = _CONTEXTS

    @property
    def name(self) -> str:
        return "dtrun-vast-query"

    def install(self, extension_context: Any) -> None:
        del extension_context
        install()
