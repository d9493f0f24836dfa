"""`python -m openrld.worker`: serve a built-in engine to the daemon that started this process.

The launcher sets OPENRLD_WORKER_SOCKET, OPENRLD_WORKER_TOKEN and OPENRLD_WORKER_ROLE;
the daemon's Start says which engine to build.
"""

from openrld.worker.builtin import build, ready_info
from openrld.worker.server import serve

if __name__ == "__main__":
    serve(build, engine="builtin", info=ready_info)
