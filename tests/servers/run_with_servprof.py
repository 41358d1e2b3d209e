"""Serve one of the test servers with servprof added the way a user adds it (one line), in a
fresh process, configured through SERVPROF_* variables:

    python tests/servers/run_with_servprof.py servers.handwritten_loop PORT [LIFESPAN]

LIFESPAN: uvicorn's --lifespan (auto, on, off; default auto).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, so "servers.x" imports

from servprof import ServprofMiddleware  # noqa: E402

if __name__ == "__main__":
    module, port = sys.argv[1], int(sys.argv[2])
    lifespan = sys.argv[3] if len(sys.argv) > 3 else "auto"
    app = importlib.import_module(module).app
    app.add_middleware(ServprofMiddleware)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan)
