"""``python -m bladellm.serve``: replicas of blade_llm_server on a Ray cluster (docs/router.md).

    python -m bladellm.serve --num_replicas 4 --port 8000 [--ray_address auto] \
        -- --model /models/M --kv_cache_memory 8GiB
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, _, server_args = (argv[:argv.index("--")], "--", argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, "", [])
    p = argparse.ArgumentParser(prog="python -m bladellm.serve", description=(
        "Run blade_llm_server replicas on Ray Serve behind the prompt-cache affinity router. "
        "Flags after -- go to every blade_llm_server."))
    p.add_argument("--num_replicas", type=int, default=2)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ray_address", default=None,
                   help="an existing cluster ('auto' or ray://...); default: start a local one")
    p.add_argument("--overload_margin", type=int, default=4)
    p.add_argument("--affinity_balance_factor", type=float, default=0.0,
                   help="bounded loads (docs/router.md); 0 (default) turns the bound off")
    args = p.parse_args(own)
    if args.num_replicas < 1:
        p.error("--num_replicas must be >= 1")
    if args.affinity_balance_factor != 0 and args.affinity_balance_factor < 1:
        p.error("--affinity_balance_factor must be 0 (off) or >= 1")
    import ray
    from ray import serve

    from bladellm.serve.app import build_app

    ray.init(address=args.ray_address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(server_args, args.num_replicas, args.overload_margin,
                        affinity_balance_factor=args.affinity_balance_factor),
              name="bladellm", route_prefix="/")
    print(f"BladeLLM on Ray Serve ready at http://{args.host}:{args.port} "
          f"({args.num_replicas} replicas)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
