"""servprof: a profiler that lives inside LLM inference servers.

Public API (everything else is internal and may change):

    from servprof import ServprofMiddleware, Settings, phase, current_request_id
    app.add_middleware(ServprofMiddleware)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["ServprofMiddleware", "Settings", "phase", "current_request_id", "annotate_request", "__version__"]

# Imported lazily so `import servprof` stays cheap (phase and the middleware pull in torch).
_LAZY = {
    "ServprofMiddleware": "servprof.middleware",
    "Settings": "servprof.settings",
    "phase": "servprof.phases",
    "current_request_id": "servprof.request_context",
    "annotate_request": "servprof.request_context",
}

if TYPE_CHECKING:
    from servprof.middleware import ServprofMiddleware
    from servprof.phases import phase
    from servprof.request_context import annotate_request, current_request_id
    from servprof.settings import Settings


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'servprof' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
